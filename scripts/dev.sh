#!/usr/bin/env bash
# One entry point for a fresh Debian machine (root, no GPU):
#   scripts/dev.sh demo   set everything up, then run the demo in a systemd sandbox
#   scripts/dev.sh test   set everything up, then run lint, types and the whole test suite
#   scripts/dev.sh test --quick
#                         lint, types and the unit tests only (the inner loop; CI runs all)
#   scripts/dev.sh setup  only set up
# Extra arguments after `test` go to pytest. Every `test` run ends with the time
# of each phase (set-up, lint and types, unit, the wait for serving-0.7, integration).
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
VENVS_LOG=${TMPDIR:-/tmp}/k26-serving-venvs.$$.log

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# libsystemd-dev, pkg-config, gcc, python3-dev: pystemd builds from source.
# systemd, dbus, dbus-user-session (its dbus.socket): the sandbox's user manager.
# systemd-container: systemd-nspawn for the booted host. polkitd: polkit's real
# daemon, inside the booted host. dpkg-dev, debhelper, lintian, python3.11-venv:
# the Debian package (scripts/deb.sh builds it with Debian 12's python3.11).
# debootstrap: the Debian 13 root its install test boots.
# apache2-utils: htpasswd, the bcrypt password file of the registry auth test
# (tests/integration/test_registry_auth.py; docker-registry reads bcrypt only).
# skopeo, openssl: the signed-bundle interop check (tests/integration/
# test_registry_signing.py; openssl makes the keys and verifies our signatures;
# Debian 12's skopeo finds cosign's .sig attachments but has sigstore verification
# disabled; cosign itself, which Debian 12 lacks, is Debian 13's, unpacked by
# scripts/tools.sh).
APT_PACKAGES="libsystemd-dev pkg-config systemd systemd-container dbus dbus-user-session polkitd util-linux gcc python3-dev procps dpkg-dev debhelper lintian python3.11-venv python3.11-dev debootstrap apache2-utils skopeo openssl"

apt_install() {
    local missing=() pkg
    for pkg in $APT_PACKAGES; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    log "apt: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # No package's service may start because of us (policy-rc.d(8): 101 = not allowed).
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        APT_GUARD=/usr/sbin/policy-rc.d # on_exit removes it, whatever happens
        printf '#!/bin/sh\n# k26-supervisor scripts/dev.sh: no service starts during this install\nexit 101\n' >"$APT_GUARD"
        chmod 0755 "$APT_GUARD"
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if [[ -n ${APT_GUARD:-} ]]; then
        rm -f "$APT_GUARD"
        APT_GUARD=""
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
    if [[ ! -f $stamp || pyproject.toml -nt $stamp || devtools/pyproject.toml -nt $stamp ]]; then
        log "venv: installing k26-supervisor and its dev tools"
        "$VENV/bin/pip" install -q --upgrade pip
        # Two distributions, both editable, in one command: the product (its test and lint
        # tools in [dev]) and the development tools (devtools/: k26dev, k26-dev), whose
        # dependency on k26-supervisor pip meets with the first (it is on no index).
        "$VENV/bin/pip" install -q -e ".[dev]" -e ./devtools
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
    trap on_exit EXIT
}

# One import check of each serving venv per run (scripts/serving-venv.sh records
# each passed check here; every test worker and demo after it trusts the record).
checked_once() {
    K26_SERVING_CHECKED=$(mktemp -d "${TMPDIR:-/tmp}/k26-serving-checked.XXXXXX")
    export K26_SERVING_CHECKED
}

on_exit() {
    local rc=$?
    [[ -z ${APT_GUARD:-} ]] || rm -f "$APT_GUARD"
    [[ -z ${K26_SERVING_CHECKED:-} ]] || rm -rf "$K26_SERVING_CHECKED"
    if [[ -n ${K26_SANDBOX_REGISTRY:-} ]]; then
        "$VENV/bin/k26-dev" sandbox sweep --force --registry "$K26_SANDBOX_REGISTRY" >&2 || true
        rm -f "$K26_SANDBOX_REGISTRY"
    fi
    if [[ -n ${VENVS_PID:-} ]] && kill -0 "$VENVS_PID" 2>/dev/null; then
        kill -- "-$VENVS_PID" 2>/dev/null || true
    fi
    rm -f "$VENVS_LOG"
    phase_table
    return "$rc"
}

# --- phase times: each `test` run ends with them -------------------------------------
PHASES=()
phase() { # phase NAME: the current phase ends, NAME begins
    local now=${EPOCHREALTIME/,/.}
    if [[ -n ${PHASE_NAME:-} ]]; then
        PHASES+=("$PHASE_NAME $(awk -v a="$PHASE_START" -v b="$now" 'BEGIN { printf "%.0f", b - a }')")
    fi
    PHASE_NAME=$1
    PHASE_START=$now
}
phase_table() {
    [[ -n ${PHASE_NAME:-} ]] || return 0
    phase ""
    local total=0 row name secs
    printf '\n%s\n' "==> phase times (s)" >&2
    for row in "${PHASES[@]}"; do
        name=${row% *} secs=${row##* }
        total=$((total + secs))
        printf '  %-28s %6d  (%d:%02d)\n' "$name" "$secs" $((secs / 60)) $((secs % 60)) >&2
    done
    printf '  %-28s %6d  (%d:%02d)\n' "total" "$total" $((total / 60)) $((total % 60)) >&2
}

# pytest, where "no test matched" (exit 5: a path or -k outside this half) is no failure.
run_pytest() {
    local rc=0
    "$VENV/bin/pytest" "$@" || rc=$?
    ((rc == 5)) && rc=0
    return "$rc"
}

cmd=${1:-}
shift || true
case $cmd in
    setup)
        trap on_exit EXIT
        setup
        ;;
    demo)
        trap on_exit EXIT
        setup
        log "serving venv: FlashInfer 0.7.4 for the demo's real warm-up (first run: a few minutes)"
        checked_once
        scripts/serving-venv.sh 0.7
        registry
        "$VENV/bin/k26-dev" demo "$@"
        ;;
    test)
        quick=0
        if [[ ${1:-} == --quick ]]; then
            quick=1
            shift
        fi
        trap on_exit EXIT
        phase "set-up"
        setup
        if ((!quick)); then
            checked_once
            # The serving venvs (a fresh machine downloads about 15 GB) are made while
            # lint, types and the unit tests run; only the integration tests need them.
            log "serving venvs: real FlashInfer releases, in the background (log: $VENVS_LOG)"
            # A process group of its own, so that an early exit ends pip too.
            setsid scripts/serving-venv.sh >"$VENVS_LOG" 2>&1 &
            VENVS_PID=$!
        fi
        registry
        phase "lint and types"
        log "lint: ruff"
        "$VENV/bin/ruff" check supervisor devtools tests bench deploy
        "$VENV/bin/ruff" format --check supervisor devtools tests bench deploy
        log "types: mypy --strict supervisor devtools/k26dev"
        "$VENV/bin/mypy"
        phase "unit tests"
        log "tests: unit (pytest -m 'not integration', 2 workers)"
        failed=0
        run_pytest -m "not integration" -n 2 "$@" || failed=1
        if ((quick)); then
            exit "$failed"
        fi
        # Most integration tests need serving-0.7 (about 2.7 GB, its torch from a local
        # wheel); the two CUDA-torch venvs (about 6 GB each) go on downloading while the
        # tests run, and a test that needs one waits for it under the venv's own lock.
        phase "serving venv 0.7 (wait)"
        scripts/serving-venv.sh 0.7 >/dev/null
        phase "integration tests"
        log "tests: integration (real systemd, FlashInfer builds, booted hosts; grouped workers)"
        run_pytest -m integration -n 3 --dist loadgroup --no-loadscope-reorder "$@" || failed=1
        if ! wait "$VENVS_PID"; then
            cat "$VENVS_LOG" >&2
            echo "error: scripts/serving-venv.sh failed (above)" >&2
            exit 1
        fi
        grep -v '^WARNING: Location' "$VENVS_LOG" >&2 || true
        exit "$failed"
        ;;
    *)
        echo "usage: scripts/dev.sh demo|test|setup [args]" >&2
        exit 64
        ;;
esac
