#!/usr/bin/env bash
# The Debian package on the lent GPU host: Ubuntu 24.04, python3.12, root, no systemd
# as PID 1, no polkitd, no network. Proves the interpreter ABI and the CLI, not a
# start (nothing here can start a systemd unit):
#   dpkg -i --force-depends (the postinst builds the venv with Ubuntu's python3.12
#   from the package's wheels, offline), the venv's compiled modules imported,
#   k26-supervisor --version, check-config of the shipped config, flashinfer doctor
#   against the kit's SGLang site's FlashInfer (when this machine has the kit
#   unpacked: bench/gpu/kit_setup.sh), then dpkg --purge and what is left.
#
#   bash bench/gpu/package_ubuntu.sh DEB OUT_DIR     (transcript: OUT_DIR/transcript.txt)
#
# Every step is run and recorded, failed or not; the exit status is the number of
# required steps that failed (the FlashInfer doctor's verdict is recorded, not required:
# a verdict of "missing modules" is its job).
set -uo pipefail
DEB=${1:?usage: package_ubuntu.sh DEB OUT_DIR}
OUT=${2:?usage: package_ubuntu.sh DEB OUT_DIR}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
T=$OUT/transcript.txt
: >"$T"
failed=0
step() {
    printf '\n$ %s\n' "$*" >>"$T"
    "$@" >>"$T" 2>&1
    local rc=$?
    printf '[exit %d]\n' "$rc" >>"$T"
    return "$rc"
}
must() { step "$@" || failed=$((failed + 1)); }

must cat /etc/os-release
must python3 -VV
must dpkg-deb -f "$DEB" Package Version Architecture Depends
# --force-depends: systemd and polkitd are not installed here. The postinst builds the
# venv first; debhelper's part after it (systemd-sysusers, systemd-tmpfiles) then
# fails for want of systemd, and the package stays half-configured: recorded, not
# counted (the CLI and the venv are what this host can prove).
step dpkg -i --force-depends "$DEB"
must dpkg-query -W -f='${Status} ${Version}\n' k26-supervisor
must cat /opt/k26-supervisor/venv/.k26-venv
must /opt/k26-supervisor/venv/bin/python -c 'import sys, pystemd.dbuslib, pystemd.daemon, pystemd.journal, pystemd.cutils, pystemd.dbusexc, pydantic_core, lxml.etree, psutil; print(sys.version); print(pystemd.dbuslib.__file__)'
must k26-supervisor --version
must k26-supervisor check-config /etc/k26-supervisor/config.toml
if [[ -d $SITE/flashinfer ]]; then
    # The serving venv the GPU benches give the daemon (supervise_real_sglang.py's
    # serving_venv): the image's python3 (its torch) with the kit's SGLang site.
    here=$(cd "$(dirname "$0")" && pwd)
    sv=$(python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path
from supervise_real_sglang import serving_venv
import os
print(serving_venv("real", Path(sys.argv[2]), Path(sys.argv[3]), dict(os.environ))[0])' \
        "$here" /tmp/k26-ubuntu-serving "$SITE")
    mkdir -p /tmp/k26-ubuntu-fi
    step k26-supervisor flashinfer doctor --python "$sv" --arch 9.0 --workspace /tmp/k26-ubuntu-fi
    rm -rf /tmp/k26-ubuntu-serving /tmp/k26-ubuntu-fi
else
    printf '\n# no FlashInfer here (%s/flashinfer absent: the kit is not unpacked on this machine)\n' "$SITE" >>"$T"
    failed=$((failed + 1))
fi
must dpkg --purge --force-depends k26-supervisor
for path in /opt/k26-supervisor /etc/k26-supervisor /usr/lib/k26-supervisor /usr/bin/k26-supervisor \
    /var/lib/k26-supervisor /var/cache/sglang-k26; do
    if [[ -e $path || -L $path ]]; then
        printf '\n# left after purge: %s\n' "$path" >>"$T"
        failed=$((failed + 1))
    fi
done
printf '\n# required steps failed: %d\n' "$failed" >>"$T"
cat "$T"
exit "$failed"
