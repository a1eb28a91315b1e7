#!/usr/bin/env bash
# Fallback, on the GPU host, only if the prebuilt cp312 pystemd wheel in ../wheels does not import:
#   bash KIT/pystemd-src/build.sh [PYTHON]   -> a fresh pystemd-*.whl in KIT/wheels
# then install it with pip --no-index as usual (KIT.md step b). Compiles the sdist's own
# Cython-generated C files (no Cython needed) against the carried libsystemd 252 headers and links
# the host's libsystemd.so.0 (255 on the lent H200; else the kit's 252 copy). gcc: ~1 minute.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${1:-python3}
LIB=$(ls /usr/lib/x86_64-linux-gnu/libsystemd.so.0 /lib/x86_64-linux-gnu/libsystemd.so.0 2>/dev/null | head -1 || true)
[[ -n $LIB ]] || LIB=$HERE/../systemd/lib/libsystemd.so.0
B=$(mktemp -d)
trap 'rm -rf "$B"' EXIT
mkdir -p "$B/lib"
ln -s "$LIB" "$B/lib/libsystemd.so"
# no venv (Ubuntu's python3 may lack ensurepip): the build tools go to a private --target dir
"$PY" -m pip install -q --no-index --no-deps --target "$B/tools" "$HERE"/whl/*.whl
export K26_SD_INCLUDE=$HERE/include
PYTHONPATH=$B/tools PATH=$HERE/bin:$PATH CFLAGS="-I$HERE/include -O2 -g0" LDFLAGS="-L$B/lib -s" \
    "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index \
    -w "$HERE/../wheels" "$HERE"/pystemd-*.tar.gz
ls -l "$HERE"/../wheels/pystemd-*
