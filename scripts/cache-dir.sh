#!/usr/bin/env bash
# Prints the shared cache directory: the serving venvs, the Prometheus and
# Alertmanager binaries, the installer's wheelhouse and the staleness tests'
# toolkits live there, outside any clone, so a second clone on the same machine
# downloads nothing. $K26_SERVING_CACHE wins; else $XDG_CACHE_HOME/k26-supervisor;
# else ~/.cache/k26-supervisor. Every entry is keyed by the exact versions it holds.
# (devtools/k26dev/shared_cache.py is the same rule for Python.)
set -euo pipefail
if [[ -n ${K26_SERVING_CACHE:-} ]]; then
    echo "$K26_SERVING_CACHE"
elif [[ -n ${XDG_CACHE_HOME:-} ]]; then
    echo "$XDG_CACHE_HOME/k26-supervisor"
else
    echo "${HOME:?HOME is not set; set K26_SERVING_CACHE}/.cache/k26-supervisor"
fi
