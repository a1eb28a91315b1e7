#!/usr/bin/env bash
# One entry point for a fresh Debian machine (root, no GPU):
#   scripts/dev.sh demo   set everything up, then run the demo in a systemd sandbox
#   scripts/dev.sh test   set everything up, then run lint, types and the whole test suite
#   scripts/dev.sh setup  only set up
# Idempotent: a second run skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

need_apt=()
for pkg in libsystemd-dev pkg-config systemd dbus prometheus util-linux gcc python3-dev procps; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done

setup() {
    if ((${#need_apt[@]})); then
        log "apt: installing ${need_apt[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        # prometheus is only needed for promtool; don't let its service start.
        apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
        pkill -x prometheus 2>/dev/null || true
    fi
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "error: $PY is older than Python 3.11; set PYTHON=/path/to/python3.11" >&2
        exit 1
    fi
    if [[ ! -x $VENV/bin/python ]]; then
        log "venv: creating $VENV"
        "$PY" -m venv "$VENV"
    fi
    local stamp=$VENV/.k26-installed
    if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
        log "venv: installing k26-supervisor and its dev tools"
        "$VENV/bin/pip" install -q --upgrade pip
        "$VENV/bin/pip" install -q -e ".[dev]"
        touch "$stamp"
    fi
}

sweep() { "$VENV/bin/k26-supervisor" sandbox sweep --force >/dev/null 2>&1 || true; }

cmd=${1:-}
shift || true
case $cmd in
    setup)
        setup
        ;;
    demo)
        setup
        log "serving venv: FlashInfer 0.7.4 for the demo's real warm-up (first run: a few minutes)"
        scripts/serving-venv.sh 0.7
        trap sweep EXIT
        "$VENV/bin/k26-supervisor" demo "$@"
        ;;
    test)
        setup
        log "serving venv: real FlashInfer releases for the warm-up tests"
        scripts/serving-venv.sh
        trap sweep EXIT
        log "lint: ruff"
        "$VENV/bin/ruff" check supervisor tests bench
        "$VENV/bin/ruff" format --check supervisor tests bench
        log "types: mypy --strict supervisor"
        "$VENV/bin/mypy"
        log "tests: pytest (unit, integration, flashinfer, precompile)"
        "$VENV/bin/pytest" "$@"
        ;;
    *)
        echo "usage: scripts/dev.sh demo|test|setup [args]" >&2
        exit 64
        ;;
esac
