#!/usr/bin/env bash
# One entry point for a fresh Debian machine (root, no GPU):
#   scripts/dev.sh demo   set everything up, then run the demo in a systemd sandbox
#   scripts/dev.sh test   set everything up, then run lint, types and the whole test suite
#   scripts/dev.sh setup  only set up
# Idempotent: a second run skips what is already in place.
#
# It changes this machine only by installing the Debian packages below (with
# services kept from starting while apt runs), by writing under .venv/, and by
# filling the shared cache outside the clone (scripts/cache-dir.sh: $K26_SERVING_CACHE,
# else ~/.cache/k26-supervisor) with the serving venvs and tool binaries, keyed by
# their exact versions, so a second clone downloads nothing. Prometheus and
# Alertmanager are not installed as packages at all: scripts/tools.sh unpacks
# Debian's binaries into that cache, so no service of theirs exists here. A sandbox that a run leaves behind (a killed test) is swept
# on exit, and only the sandboxes this run made.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# libsystemd-dev, pkg-config, gcc, python3-dev: pystemd builds from source.
# systemd, dbus, dbus-user-session (its dbus.socket): the sandbox's user manager.
# systemd-container: systemd-nspawn for the booted host. polkitd: polkit's real
# daemon, inside the booted host.
APT_PACKAGES="libsystemd-dev pkg-config systemd systemd-container dbus dbus-user-session polkitd util-linux gcc python3-dev procps"

apt_install() {
    local missing=() pkg
    for pkg in $APT_PACKAGES; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    log "apt: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # No package's service may start because of us (policy-rc.d(8): 101 = not allowed).
    local guard=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        guard=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\n# k26-supervisor scripts/dev.sh: no service starts during this install\nexit 101\n' >"$guard"
        chmod 0755 "$guard"
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [[ -n $guard ]]; then
        rm -f "$guard"
        trap - EXIT
    fi
}

setup() {
    apt_install
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
    log "tools: Debian's prometheus, promtool, alertmanager binaries (no service)"
    scripts/tools.sh
}

# Every sandbox this run brings up writes its name here; on exit, only those are
# swept (another run's sandbox, or a user's, is never touched).
registry() {
    K26_SANDBOX_REGISTRY=$(mktemp "${TMPDIR:-/tmp}/k26-sandboxes.XXXXXX")
    export K26_SANDBOX_REGISTRY
    trap '"$VENV/bin/k26-supervisor" sandbox sweep --force --registry "$K26_SANDBOX_REGISTRY" >&2 || true; rm -f "$K26_SANDBOX_REGISTRY"' EXIT
}

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
        registry
        "$VENV/bin/k26-supervisor" demo "$@"
        ;;
    test)
        setup
        log "serving venv: real FlashInfer releases for the warm-up tests"
        scripts/serving-venv.sh
        registry
        log "lint: ruff"
        "$VENV/bin/ruff" check supervisor tests bench deploy
        "$VENV/bin/ruff" format --check supervisor tests bench deploy
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
