#!/usr/bin/env bash
# Puts the tools the tests and benchmarks drive into the shared cache
# (scripts/cache-dir.sh), keyed by their exact versions, without installing a
# package or a service: Debian's own prometheus, promtool,
# prometheus-alertmanager and amtool binaries, and docker-registry (the CNCF
# distribution server, an OCI registry the bundle tests push to and pull from),
# taken from their .deb files with `apt-get download` and unpacked with `dpkg -x`;
# and cosign (the signed-bundle interop check), which Debian 12 lacks: Debian 13's
# (a static Go binary needing libc6 >= 2.34) runs here. It comes through apt itself
# from a private list of trixie's main, its InRelease checked against this machine's
# archive keys, in a state directory of its own: the machine's apt state is untouched.
# No maintainer script runs, so nothing is enabled, started or registered with
# dpkg on this machine; a Prometheus or registry the user runs is never touched.
# Idempotent (a marker records what was unpacked).
#   Usage: scripts/tools.sh          make (or check) CACHE/tools-KEY
#          scripts/tools.sh path     print that directory (its bin/ holds the tools)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PACKAGES="prometheus=2.42.0+ds-5+deb12u1 prometheus-alertmanager=0.25.0-1+b4 docker-registry=2.8.2+ds1-1"
TRIXIE_PACKAGES="cosign=2.5.0-2+b5"
SPEC="v2 $PACKAGES trixie:$TRIXIE_PACKAGES"
DIR=$("$ROOT/scripts/cache-dir.sh")/tools-$(printf '%s' "$SPEC" | sha256sum | cut -c1-10)
if [[ ${1:-} == path ]]; then
    echo "$DIR"
    exit 0
fi

die() { echo "tools: $*" >&2; exit 1; }

mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9
# Reused only if the marker matches and every tool still runs.
if [[ -f $DIR/.k26-tools && $(cat "$DIR/.k26-tools") == "$SPEC" ]] \
    && "$DIR/bin/promtool" --version >/dev/null 2>&1 \
    && "$DIR/bin/alertmanager" --version >/dev/null 2>&1 \
    && "$DIR/bin/docker-registry" --version >/dev/null 2>&1 \
    && "$DIR/bin/cosign" version >/dev/null 2>&1; then
    echo "tools: ready ($DIR/bin)"
    exit 0
fi
command -v apt-get >/dev/null || die "apt-get not found (Debian/Ubuntu needed for the tool binaries)"
rm -rf "$DIR"
mkdir -p "$DIR/debs" "$DIR/root" "$DIR/bin"
# apt-get download runs as the _apt user where it can; a root-only directory makes
# it fall back to root with a warning, so give it one it may write.
chmod 0755 "$DIR" "$DIR/debs"
(
    cd "$DIR/debs"
    # shellcheck disable=SC2086  # word splitting is the point
    if ! apt-get download -q $PACKAGES 2>download.err; then
        # An exact version may have left the mirror: take the current one.
        apt-get download -q $(echo "$PACKAGES" | sed -E 's/=[^ ]+//g') 2>>download.err || {
            cat download.err >&2
            die "apt-get download failed (run apt-get update?)"
        }
    fi
)
(
    cd "$DIR/debs"
    apt=(-o "Dir::Etc::SourceList=$DIR/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
         -o "Dir::State::Lists=$DIR/apt/lists" -o "Dir::Cache=$DIR/apt/cache"
         -o Dir::State::status=/dev/null)
    mkdir -p "$DIR/apt/lists/partial" "$DIR/apt/cache/archives/partial"
    chmod -R 0755 "$DIR/apt"
    echo "deb http://deb.debian.org/debian trixie main" >"$DIR/apt/sources.list"
    apt-get "${apt[@]}" update -q >>download.err 2>&1 || {
        cat download.err >&2
        die "apt-get update of Debian 13 (trixie) failed: cosign comes from there"
    }
    # shellcheck disable=SC2086
    if ! apt-get "${apt[@]}" download -q $TRIXIE_PACKAGES 2>>download.err; then
        apt-get "${apt[@]}" download -q $(echo "$TRIXIE_PACKAGES" | sed -E 's/=[^ ]+//g') \
            2>>download.err || { cat download.err >&2; die "apt-get download of cosign failed"; }
    fi
)
rm -rf "$DIR/apt"
for deb in "$DIR"/debs/*.deb; do
    dpkg -x "$deb" "$DIR/root"
done
for tool in prometheus promtool prometheus-alertmanager amtool docker-registry cosign; do
    [[ -x $DIR/root/usr/bin/$tool ]] || die "$tool missing from the unpacked packages"
    ln -sf "../root/usr/bin/$tool" "$DIR/bin/$tool"
done
ln -sf "../root/usr/bin/prometheus-alertmanager" "$DIR/bin/alertmanager"
"$DIR/bin/promtool" --version >/dev/null || die "promtool does not run"
"$DIR/bin/docker-registry" --version >/dev/null || die "docker-registry does not run"
"$DIR/bin/cosign" version >/dev/null 2>&1 || die "cosign does not run"
echo "$SPEC" >"$DIR/.k26-tools"
echo "tools: ready ($DIR/bin)"
