#!/usr/bin/env bash
# Creates the serving venvs that the FlashInfer tests, the demo and the benchmarks
# drive, in the shared cache outside the clone (scripts/cache-dir.sh): a second
# clone on the same machine downloads nothing. Works on a fresh machine of this kind
# (Debian, Python 3.11, gcc, nvcc 13 under /usr/local/cuda, no GPU); CI runs it from
# a clean clone.
#
#   serving-0.7  torch 2.13.0 (CPU wheel from /opt/wheels) + flashinfer-python 0.7.4
#                + nvidia-curand: the gate accepts 12.0 and the real sampling module
#                builds with nvcc 13 (about 2.7 GB).
#   serving-0.2  torch 2.6.0 (PyPI, CUDA 12.4 build) + flashinfer-python 0.2.14.post1:
#                a real combination whose gate rejects 12.0, because torch 2.6 does
#                not know that arch (about 6 GB).
#   serving-0.7.0-cu128
#                torch 2.8.0 (PyPI, CUDA 12.8 build) + flashinfer-python 0.7.0, on a
#                host without a CUDA toolkit (CUDA_HOME names an empty directory), so
#                FlashInfer takes CUDA 12.8 from torch: the gate rejects 12.0 with
#                "SM 12.x requires CUDA >= 12.9", the bug FlashInfer PR #3633 fixed
#                in 0.7.1 (about 6 GB).
#
# Each venv lives at CACHE/serving-NAME-KEY, where KEY hashes its exact spec (the
# pinned versions) and the base Python's exact version: two clones that want other
# versions never share, or fight over, one directory. Before a venv is reused it
# must pass its import check (torch and FlashInfer import, at exactly the pinned
# versions); one that fails is rebuilt, never trusted. Within one run of
# scripts/dev.sh (which sets K26_SERVING_CHECKED to a directory of its own), a check
# passed is recorded there against the venv's marker, and the run's later callers
# (each test worker, each demo) trust that record while the marker is the same file:
# a rebuild replaces it. Each check imports torch and FlashInfer, about 4 CPU-s.
#
# Each venv gets k26-build.env, the environment a build needs here (KEY=VALUE, for
# `k26-supervisor flashinfer ... --env-file`):
#   CUDA_HOME        the toolkit (the /usr/local/bin/nvcc wrapper would make FlashInfer
#                    resolve /usr/local, which has no CUDA headers)
#   CPATH            curand.h, which this toolkit lacks (pip package nvidia-curand)
#   LIBRARY_PATH     the toolkit's lib (-lcudart), and on a host with no NVIDIA driver a
#                    stub libcuda.so (-lcuda); where the driver is installed its real
#                    library is used and the stub is never on any path (it would shadow it)
#   LD_LIBRARY_PATH  the same, so that doctor can load the module as FlashInfer does
#
#   Usage: scripts/serving-venv.sh [0.7|0.2|0.7.0-cu128|all]   make (or check) them
#          scripts/serving-venv.sh path NAME    print NAME's venv directory (makes nothing)
#          scripts/serving-venv.sh env NAME     print NAME's k26-build.env to stdout
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=$("$ROOT/scripts/cache-dir.sh")
BASE_PYTHON=${K26_BASE_PYTHON:-python3.11}
TORCH_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
WHICH=${1:-all}

die() { echo "serving-venv: $*" >&2; exit 1; }

cuda_home() {
    if [[ -n ${CUDA_HOME:-} && -x $CUDA_HOME/bin/nvcc ]]; then echo "$CUDA_HOME"; return; fi
    if [[ -x /usr/local/cuda/bin/nvcc ]]; then echo /usr/local/cuda; return; fi
    die "no CUDA toolkit: set CUDA_HOME to a directory with bin/nvcc"
}

# spec NAME -> the text that, when it changes, makes another venv
spec() {
    case $1 in
    0.7) echo "v2 torch=2.13.0+cpu flashinfer-python==0.7.4 nvidia-curand==10.4.5.25 stub=libcuda.so.1" ;;
    0.2) echo "v2 torch==2.6.0 flashinfer-python==0.2.14.post1" ;;
    0.7.0-cu128) echo "v1 torch==2.8.0 flashinfer-python==0.7.0 no-toolkit" ;;
    *) die "no serving venv named '$1' (0.7, 0.2 or 0.7.0-cu128)" ;;
    esac
}

# The import check a venv must pass before it is reused: "torch==V flashinfer==V".
pins() {
    case $1 in
    0.7) echo "2.13.0+cpu 0.7.4" ;;
    0.2) echo "2.6.0+cu124 0.2.14.post1" ;;
    0.7.0-cu128) echo "2.8.0+cu128 0.7.0" ;;
    esac
}

base_version() {
    "$BASE_PYTHON" -c 'import platform; print(platform.python_version())'
}

venv_dir() {
    local want key
    want="$(spec "$1") python=$(base_version)"
    key=$(printf '%s' "$want" | sha256sum | cut -c1-10)
    echo "$CACHE/serving-$1-$key"
}

install() {
    local name=$1 venv=$2
    case $name in
    0.7)
        local torch=$TORCH_WHEEL
        [[ -f $torch ]] || torch="torch==2.13.0"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "$torch"
        "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "flashinfer-python==0.7.4" "nvidia-curand==10.4.5.25" "torch==2.13.0"
        ;;
    0.2)
        "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "torch==2.6.0" "flashinfer-python==0.2.14.post1"
        ;;
    0.7.0-cu128)
        "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "torch==2.8.0" "flashinfer-python==0.7.0"
        ;;
    esac
}

# The venv imports torch and FlashInfer at exactly the pinned versions.
import_check() {
    local name=$1 venv=$2 torch fi
    read -r torch fi <<<"$(pins "$name")"
    [[ -x $venv/bin/python ]] || return 1
    # Importing writes FlashInfer's JIT log and (torch 2.8) builds tvm-ffi's DLPack
    # addon: into the venv, never the user's ~/.cache/flashinfer or ~/.cache/tvm-ffi.
    FLASHINFER_WORKSPACE_BASE=$venv/k26-import-check TVM_FFI_CACHE_DIR=$venv/k26-import-check/tvm-ffi \
        "$venv/bin/python" - "$torch" "$fi" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
import torch, flashinfer  # noqa: E401  the imports themselves are the check
want_torch, want_fi = sys.argv[1:3]
sys.exit(0 if (torch.__version__, version("flashinfer-python")) == (want_torch, want_fi) else 1)
PY
}

# This run's record of a passed import check (K26_SERVING_CHECKED): the venv and its
# marker's inode and mtime, which a rebuild changes.
record_of() { echo "$2 $(stat -c '%i %.9Y' "$2/.k26-serving-venv" 2>/dev/null)"; }
checked_this_run() { # checked_this_run NAME VENV
    local record=${K26_SERVING_CHECKED:-}/serving-$1
    [[ -n ${K26_SERVING_CHECKED:-} && -f $record && $(<"$record") == "$(record_of "$1" "$2")" ]]
}
note_checked() { # note_checked NAME VENV
    [[ -n ${K26_SERVING_CHECKED:-} && -d $K26_SERVING_CHECKED ]] || return 0
    record_of "$1" "$2" >"$K26_SERVING_CHECKED/serving-$1.tmp"
    mv "$K26_SERVING_CHECKED/serving-$1.tmp" "$K26_SERVING_CHECKED/serving-$1"
}

# The NVIDIA driver's libcuda.so.1 is known to the dynamic loader (not our stub).
has_driver() {
    ldconfig -p 2>/dev/null | grep -v k26-stub | grep -q 'libcuda\.so\.1 '
}

# The env file's text for the venv NAME at VENV, on stdout.
build_env() {
    local name=$1 venv=$2 home site libs
    if [[ $name == 0.7.0-cu128 ]]; then
        # A runtime-only host: no nvcc where FlashInfer looks, so it asks torch.
        mkdir -p "$venv/k26-no-toolkit"
        echo "CUDA_HOME=$venv/k26-no-toolkit"
        return
    fi
    home=$(cuda_home)
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    libs=$home/lib64
    if ! has_driver; then
        mkdir -p "$venv/k26-stub"
        # An empty library named like the driver satisfies `-lcuda` at link time.
        printf '' | gcc -x c -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$venv/k26-stub/libcuda.so" -
        ln -sf libcuda.so "$venv/k26-stub/libcuda.so.1"
        libs=$libs:$venv/k26-stub
    fi
    echo "CUDA_HOME=$home"
    if [[ -d $site/nvidia/cu13/include ]]; then echo "CPATH=$site/nvidia/cu13/include"; fi
    echo "LIBRARY_PATH=$libs"
    echo "LD_LIBRARY_PATH=$libs"
}

write_env() {
    build_env "$1" "$2" >"$2/k26-build.env.tmp"
    mv "$2/k26-build.env.tmp" "$2/k26-build.env"
}

make_venv() {
    local name=$1 venv marker
    venv=$(venv_dir "$name")
    marker=$venv/.k26-serving-venv
    if [[ -f $marker ]]; then
        if checked_this_run "$name" "$venv" || import_check "$name" "$venv"; then
            note_checked "$name" "$venv"
            write_env "$name" "$venv" # cheap, and the host may have gained or lost a driver
            echo "serving-$name: ready ($venv)"
            return
        fi
        echo "serving-$name: $venv fails its import check; rebuilding it" >&2
    fi
    echo "serving-$name: creating $venv ($(spec "$name"))"
    rm -rf "$venv"
    "$BASE_PYTHON" -m venv "$venv"
    install "$name" "$venv"
    import_check "$name" "$venv" || die "serving-$name: the new venv $venv fails its import check"
    write_env "$name" "$venv"
    spec "$name" >"$marker"
    note_checked "$name" "$venv"
    echo "serving-$name: ready ($venv)"
}

command -v "$BASE_PYTHON" >/dev/null || die "$BASE_PYTHON not found"
case $WHICH in
path)
    venv_dir "${2:?usage: $0 path NAME}"
    exit 0
    ;;
esac
command -v gcc >/dev/null || die "gcc not found (needed for the stub libcuda.so)"
mkdir -p "$CACHE"

# One maker of each venv at a time, across clones and test workers; each venv has a
# lock of its own, so that a test that needs serving-0.7 runs while serving-0.2 is
# still downloading.
locked() { # locked NAME COMMAND...: COMMAND under NAME's lock
    local name=$1
    shift
    (
        exec 9>"$CACHE/.serving-$name.lock"
        flock 9
        "$@"
    )
}

case $WHICH in
env)
    venv=$(venv_dir "${2:?usage: $0 env NAME}")
    [[ -x $venv/bin/python ]] || die "env: no venv serving-$2 at $venv (run $0 $2)"
    locked "$2" build_env "$2" "$venv"
    ;;
0.7 | 0.2 | 0.7.0-cu128) locked "$WHICH" make_venv "$WHICH" ;;
all) for name in 0.7 0.2 0.7.0-cu128; do locked "$name" make_venv "$name"; done ;;
*) die "usage: $0 [0.7|0.2|0.7.0-cu128|all|path NAME|env NAME]" ;;
esac
