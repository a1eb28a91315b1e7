#!/usr/bin/env bash
# The Debian package, built from this checkout; prints the .deb's path on stdout.
#   scripts/deb.sh          build/deb/k26-supervisor_<version>_<arch>.deb (built, or reused)
#
# Copies only what the package is made from (INPUTS) into build/deb/src, runs
# `dpkg-buildpackage -us -uc -b` there with K26_WHEELHOUSE set to the shared cache's
# wheelhouse (python -m k26dev.shared_cache wheelhouse: every dependency as a wheel,
# made once per pyproject.toml), then lintian on the result. Any lintian tag that
# debian/*lintian-overrides does not explain fails the build; the report is kept
# in build/deb/lintian.txt, the build's log in build/deb/build.log. A build whose
# inputs are unchanged is reused, and one build runs at a time (a lock), so test
# workers and scripts/dev.sh can all ask for it. Needs debhelper, dpkg-dev and
# lintian (scripts/dev.sh's apt step) and the project venv (.venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/build/deb
VENV=$ROOT/.venv
# What the package is made from: nothing else is copied, and only these decide a rebuild.
INPUTS=(pyproject.toml supervisor units deploy config debian README.md docs/units.md)

log() { printf '==> %s\n' "$*" >&2; }
die() {
    echo "scripts/deb.sh: error: $*" >&2
    exit 1
}

for tool in dpkg-buildpackage dh lintian flock git; do
    command -v "$tool" >/dev/null || die "$tool not found: run scripts/dev.sh setup (it installs debhelper, dpkg-dev and lintian)"
done
[[ -x $VENV/bin/python ]] || die "no project venv at $VENV: run scripts/dev.sh setup"

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9

LIST=$OUT/.inputs
git ls-files -co --exclude-standard -- "${INPUTS[@]}" | LC_ALL=C sort -u | while IFS= read -r f; do
    [[ -e $f || -L $f ]] && printf '%s\n' "$f"
done >"$LIST"
digest=$(tar -cf - --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --no-recursion \
    -T "$LIST" | sha256sum | cut -c1-16)
if [[ -f $OUT/.digest && $(head -1 "$OUT/.digest") == "$digest" ]]; then
    deb=$OUT/$(sed -n 2p "$OUT/.digest")
    if [[ -f $deb ]]; then
        log "deb: $deb is up to date ($digest)"
        printf '%s\n' "$deb"
        exit 0
    fi
fi

log "deb: building from $(wc -l <"$LIST") files ($digest)"
rm -rf "$OUT/src" "$OUT"/*.deb "$OUT"/*.changes "$OUT"/*.buildinfo "$OUT/.digest"
SRC=$OUT/src/k26-supervisor
mkdir -p "$SRC"
tar -cf - --no-recursion -T "$LIST" | tar -xf - -C "$SRC"
log "deb: wheelhouse (the shared cache's; downloaded the first time only)"
WHEELHOUSE=$("$VENV/bin/python" -m k26dev.shared_cache wheelhouse)
started=$SECONDS
if ! (cd "$SRC" && K26_WHEELHOUSE=$WHEELHOUSE dpkg-buildpackage -us -uc -b) >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log" >&2
    die "dpkg-buildpackage failed (the whole log: $OUT/build.log)"
fi
mv "$OUT/src"/*.deb "$OUT/src"/*.changes "$OUT/src"/*.buildinfo "$OUT/"
changes=$(ls "$OUT"/*.changes)
deb=$(ls "$OUT"/*.deb)
log "deb: built $(basename "$deb") in $((SECONDS - started)) s; lintian"
if ! lintian --allow-root --info --pedantic --fail-on error,warning,info,pedantic "$changes" >"$OUT/lintian.txt" 2>&1; then
    cat "$OUT/lintian.txt" >&2
    die "lintian: tags above are neither fixed nor explained in debian/*lintian-overrides"
fi
cat "$OUT/lintian.txt" >&2
printf '%s\n%s\n' "$digest" "$(basename "$deb")" >"$OUT/.digest"
printf '%s\n' "$deb"
