#!/usr/bin/env bash
# The GPU check in one command, on a GPU host that may lack the serving packages:
#
#   bench/gpu/run.sh [sampling_check.py options]      (e.g. --out DIR, --skip-cold)
#
# Uses what bench/gpu/prepare.py left in bench/gpu/.work (carry that folder). Installs nothing
# into the host's Python: what it lacks goes to $SITE (default /tmp/k26-gpu-site), from
#   .work/whl/*.whl                            apache-tvm-ffi (enough to load the module)
#   .work/flashinfer_python-*-subset.tar.xz    flashinfer's own files, for the cold JIT build
# PY picks the interpreter (default python3, the one that has torch with CUDA).
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${KIT:-bench/gpu/.work}
PY=${PY:-python3}
SITE=${SITE:-/tmp/k26-gpu-site}
brought=()
mkdir -p "$SITE"
if ! "$PY" -c 'import tvm_ffi' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$KIT"/whl/*.whl
    brought+=("$(cd "$KIT"/whl && ls *.whl)")
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("flashinfer") is None)'; then
    tar -xJf "$KIT"/flashinfer_python-*-sampling-subset.tar.xz -C "$SITE"
    brought+=("$(basename "$KIT"/flashinfer_python-*-sampling-subset.tar.xz)")
fi
export K26_BROUGHT="${brought[*]:-nothing}"
echo "brought: $K26_BROUGHT"
exec "$PY" -u bench/gpu/sampling_check.py --cache "$KIT/cache" "$@"
