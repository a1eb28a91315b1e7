#!/usr/bin/env bash
# On the lent GPU host: unpack what bench/gpu/make_kit.sh packed, install the daemon's wheels into a
# private dir, and write an env file. Touches nothing outside $SITE, $PYLIB and $KITDIR (all in /tmp
# by default); puts nothing on LD_LIBRARY_PATH (the kit's binaries find their libraries by RUNPATH).
#
#   bash bench/gpu/kit_setup.sh [CARRY_DIR]        (default CARRY_DIR: .cache/gpu/carry)
#   . /tmp/k26kit/env.sh                           (PYTHONPATH, PATH, K26_SYSTEMD_KIT)
#
# Env: PY (default python3: the image's 3.12 with torch), SITE (/tmp/site), PYLIB (/tmp/k26-pylib),
#      KITDIR (/tmp/k26kit). Idempotent; about 10 s (the site's xz is most of it).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CARRY=${1:-$ROOT/.cache/gpu/carry}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
PYLIB=${PYLIB:-/tmp/k26-pylib}
KITDIR=${KITDIR:-/tmp/k26kit}
t0=$(date +%s.%N)
mkdir -p "$SITE" "$PYLIB" "$KITDIR"
# (a) the SGLang site
if [[ -s $CARRY/site-lean.tar.xz && ! -e $SITE/.k26-unpacked ]]; then
    tar -xJf "$CARRY/site-lean.tar.xz" -C "$SITE" && touch "$SITE/.k26-unpacked"
fi
# (a') what the lean site leaves out that SGLang imports unguarded (make_kit.sh extra: deep_gemm)
if [[ -s $CARRY/site-extra.tar.xz && ! -e $SITE/.k26-extra ]]; then
    tar -xJf "$CARRY/site-extra.tar.xz" -C "$SITE" && touch "$SITE/.k26-extra"
fi
# (c) systemd + dbus (kit/systemd) and the wheels
tar -xJf "$CARRY/k26kit.tar.xz" -C "$KITDIR"
[[ -s $CARRY/kit-fallback.tar.xz ]] && tar -xJf "$CARRY/kit-fallback.tar.xz" -C "$KITDIR"
"$KITDIR/systemd/bin/systemctl" --version | head -1
"$KITDIR/systemd/bin/dbus-daemon" --version | head -1
# (b) the daemon's Python packages, into $PYLIB only (--no-deps: the set is complete with the site)
"$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PYLIB" "$KITDIR"/wheels/*.whl
# `import pystemd` imports lxml (pystemd.base): the GPU image's Python has one; k26kit does not
# (make_kit.sh pack: the carry's 64 MiB). The fallback carries a trimmed one.
if ! "$PY" -c 'import lxml.etree' 2>/dev/null; then
    if compgen -G "$KITDIR/wheels/lxml-*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$PYLIB" "$KITDIR"/wheels/lxml-*.whl
    else
        echo "kit_setup: $PY has no lxml, which pystemd imports; carry .cache/gpu/kit-fallback.tar.xz in CARRY_DIR" >&2
        exit 1
    fi
fi
check='from pystemd.dbuslib import DBus, apply_signature; import pystemd, pydantic, httpx, prometheus_client; print("pystemd", pystemd.__version__, "pydantic", pydantic.VERSION, "httpx", httpx.__version__)'
if ! PYTHONPATH=$PYLIB:$SITE "$PY" -c "$check"; then
    if [[ -x $KITDIR/pystemd-src/build.sh ]]; then
        echo "kit_setup: the prebuilt pystemd wheel does not import here; building it from source" >&2
        bash "$KITDIR/pystemd-src/build.sh" "$PY"
        "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$PYLIB" "$KITDIR"/wheels/pystemd-*.whl
        PYTHONPATH=$PYLIB:$SITE "$PY" -c "$check"
    else
        echo "kit_setup: pystemd does not import; carry .cache/gpu/kit-fallback.tar.xz in CARRY_DIR" >&2
        exit 1
    fi
fi
cat > "$KITDIR/env.sh" <<EOF
# written by bench/gpu/kit_setup.sh
export PYTHONPATH=$PYLIB:$SITE\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$KITDIR/systemd/bin:\$PATH
export K26_SYSTEMD_KIT=$KITDIR/systemd
export K26_SYSTEMD_BINARY=$KITDIR/systemd/bin/systemd
EOF
echo "kit_setup: ready in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s; . $KITDIR/env.sh"
