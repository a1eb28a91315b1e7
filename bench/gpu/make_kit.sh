#!/usr/bin/env bash
# Rebuilds, on a CPU machine with the package registries, everything the lent GPU host needs to run
# the daemon against a real (carried) systemd user manager. Idempotent: downloads are kept and reused,
# the kit trees are rebuilt from them every time. See bench/gpu/KIT.md for what lands where and how
# the GPU host uses it.
#
#   bench/gpu/make_kit.sh [all|site|extra|systemd|wheels|pack|registry] ...   (default: all)
#
# Output (all git-ignored, under .cache/gpu/):
#   sglang/site-lean.tar.xz   SGLang 0.5.17 cp312 site (shared/gpu/build-sglang-site.sh), ~50 MiB
#   kit/systemd/              systemd 252 + dbus 1.14 from Debian 12, RUNPATH-patched, self-contained
#   kit/wheels/               cp312 wheels: pystemd (built here), pydantic, httpx, ... (pip --no-index)
#   kit/pystemd-src/          fallback: pystemd sdist + libsystemd headers + build wheels + build.sh
#   carry/                    what travels (name it in `carry`): site-lean.tar.xz, k26kit.tar.xz,
#                             MANIFEST.txt (sizes, sha256, versions)
# Env: PY312 (a CPython 3.12 to build the pystemd wheel with; default: python3.12 on PATH or pyenv's),
#      SHARED (default: ../shared next to the repo), FORCE_SITE=1 (rebuild the sglang site).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
C=$ROOT/.cache/gpu
KIT=$C/kit
SHARED=${SHARED:-$ROOT/../shared}
if [[ -z ${PY312:-} ]]; then  # a real 3.12 (pyenv's shim for python3.12 may not run)
    for c in /root/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
        if [[ -n $c ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
    done
fi
PYSTEMD_VERSION=0.15.3
# the versions the project's .venv runs with (pydantic/pydantic-core as in the sglang site)
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
idna==3.20 certifi==2026.10.19.post1 prometheus-client==0.26.0"
# pystemd imports lxml (pystemd.base) and, in pystemd.futures only, psutil. lxml is trimmed below.
WHEELS="$WHEELS lxml==6.1.3 psutil==7.2.2"
# the sdist ships its Cython-generated .c files: building it needs setuptools + wheel, not Cython
BUILD_WHEELS="setuptools==80.9.0 wheel==0.45.1"
DEBS="systemd libsystemd-shared libsystemd0 libsystemd-dev dbus-daemon dbus-bin dbus-session-bus-common
libdbus-1-3 libapparmor1 libkmod2 libip4tc2 patchelf
libacl1 libaudit1 libcap-ng0 libcap2 libcrypt1 libexpat1 libgcrypt20 libgpg-error0 liblz4-1 liblzma5
libmount1 libblkid1 libpam0g libpcre2-8-0 libseccomp2 libselinux1 libzstd1"
PIPX="--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_34_x86_64
--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
log() { printf 'make_kit: %s\n' "$*" >&2; }
mkdir -p "$C"

site() {
    if [[ -s $C/sglang/site-lean.tar.xz && -z ${FORCE_SITE:-} ]]; then
        log "site: $C/sglang/site-lean.tar.xz exists (FORCE_SITE=1 to rebuild)"; return
    fi
    [[ -f $SHARED/gpu/build-sglang-site.sh ]] || { log "no $SHARED/gpu/build-sglang-site.sh"; exit 1; }
    rm -rf "$C/sglang"
    bash "$SHARED/gpu/build-sglang-site.sh" "$C/sglang"
}

# What the lean site leaves out and a path of SGLang 0.5.17 imports unguarded: with CUDA graphs
# on, EAGLE's graph capture imports layers/attention/dsa_backend.py, which does `import deep_gemm`
# (sglang requires sgl-deep-gemm==0.1.5.post1). The whole wheel, its CUTLASS headers (28 MB, 1 MB
# as xz) included: fp8 models JIT-compile DeepGEMM's block-fp8 GEMMs at CUDA-graph capture from
# them (on the H200, fp8 K2 without them: "Failed to open: .../deep_gemm/impls/smxx_layout.cuh").
# Packed as carry/site-extra.tar.xz.
extra() {
    local X=$C/sglang/extra
    rm -rf "$X"; mkdir -p "$X/whl" "$X/site"
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$X/whl" sgl-deep-gemm==0.1.5.post1
    python3 - "$X" <<'PY'
import glob, sys, zipfile
x = sys.argv[1]
zipfile.ZipFile(glob.glob(x + "/whl/sgl_deep_gemm-*.whl")[0]).extractall(x + "/site")
PY
    (cd "$X/site" && XZ_OPT="-9e -T0" tar --owner=0 --group=0 -cJf "$C/sglang/site-extra.tar.xz" .)
}

debs() {
    mkdir -p "$C/debs"
    local missing=() p
    for p in $DEBS; do compgen -G "$C/debs/${p}_*.deb" >/dev/null || missing+=("$p"); done
    ((${#missing[@]})) || return 0
    log "apt-get download ${missing[*]}"
    (cd "$C/debs" && apt-get download "${missing[@]}") || {
        apt-get update -qq && (cd "$C/debs" && apt-get download "${missing[@]}")
    }
}

systemd_kit() {
    debs
    local S=$C/stage T=$KIT/systemd P
    rm -rf "$S" "$T"; mkdir -p "$S" "$C/tools"
    for d in "$C"/debs/*.deb; do dpkg -x "$d" "$S"; done
    P=$S/usr/bin/patchelf
    mkdir -p "$T"/bin "$T"/lib "$T"/units "$T"/share/dbus-1/session.d
    # binaries: the manager and the clients the daemon and its tests use
    cp -a "$S"/lib/systemd/systemd "$S"/bin/systemctl "$S"/bin/journalctl "$S"/bin/systemd-notify \
          "$S"/usr/bin/busctl "$S"/usr/bin/systemd-run "$S"/usr/bin/systemd-cgls \
          "$S"/usr/bin/dbus-daemon "$S"/usr/bin/dbus-send "$T"/bin/
    # libraries: everything they need except glibc (libc, libm, ld-linux) and libcrypto.so.3 (4.7 MB;
    # every Python image has OpenSSL 3). Kit copies come first for the kit's binaries only (RUNPATH),
    # nothing is put on LD_LIBRARY_PATH, so the host's own programs never see them.
    local libs
    libs=$(for f in "$T"/bin/*; do LD_LIBRARY_PATH=$S/usr/lib/x86_64-linux-gnu/systemd:$S/usr/lib/x86_64-linux-gnu:$S/lib/x86_64-linux-gnu ldd "$f"; done |
           awk '/=>/ {print $1}' | sort -u | grep -vE '^(libc|libm|ld-linux-x86-64|libcrypto)\.so')
    local l src
    for l in $libs; do
        src=$(find "$S" -name "$l" \( -type f -o -type l \) | head -1)
        [[ -n $src ]] || { log "library $l is not in the downloaded debs; add its package to DEBS"; exit 1; }
        cp -L "$src" "$T/lib/$l"
    done
    for f in "$T"/bin/*; do "$P" --set-rpath '$ORIGIN/../lib' "$f"; done
    for f in "$T"/lib/*; do "$P" --set-rpath '$ORIGIN' "$f"; done
    # user units: the targets and slices a user manager needs (the GPU host has no /usr/lib/systemd/user).
    # dbus.socket/dbus.service are written per run (they name this kit's absolute dbus-daemon path).
    cp -a "$S"/usr/lib/systemd/user/*.target "$S"/usr/lib/systemd/user/*.slice \
          "$S"/usr/lib/systemd/user/systemd-exit.service "$T"/units/
    cp -a "$S"/usr/share/dbus-1/session.conf "$T"/share/dbus-1/
    cat > "$T"/env.sh <<'EOF'
# source me: puts this kit's systemd/dbus clients on PATH (no LD_LIBRARY_PATH needed: RUNPATH).
K26_SYSTEMD_KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export K26_SYSTEMD_KIT
export PATH="$K26_SYSTEMD_KIT/bin:$PATH"
export K26_SYSTEMD_BINARY="$K26_SYSTEMD_KIT/bin/systemd"
# the manager must also get SYSTEMD_UNIT_PATH=<runtime>/systemd/user:$K26_SYSTEMD_KIT/units (k26-dev sandbox sets it)
EOF
    for d in "$C"/debs/*.deb; do dpkg-deb -f "$d" Package Version | paste -sd' '; done > "$T"/VERSIONS
    # self-check: every library of every kit ELF resolves inside the kit or to glibc/libcrypto
    local bad
    bad=$(for f in "$T"/bin/* "$T"/lib/*; do env -u LD_LIBRARY_PATH ldd "$f" | awk -v f="$f" '/=>/ {print f": "$1" "$3}'; done |
          grep -vE " $T/(bin/\.\./)?lib/| /lib/x86_64-linux-gnu/(libc|libm|libcrypto)\.so| /usr/lib/x86_64-linux-gnu/(libc|libm|libcrypto)\.so" || true)
    [[ -z $bad ]] || { log "kit libraries resolve outside the kit:"; echo "$bad" >&2; exit 1; }
    "$T"/bin/systemctl --version | head -1 >&2
    log "systemd kit: $(du -sh "$T" | cut -f1) in $T"
}

wheels() {
    local W=$KIT/wheels D=$C/pydl
    if ! pkg-config --exists libsystemd 2>/dev/null; then
        log "wheels: building pystemd needs libsystemd-dev and pkg-config here: run scripts/dev.sh setup first"
        exit 1
    fi
    rm -rf "$W"; mkdir -p "$W" "$D"
    # shellcheck disable=SC2086
    pip download -q --no-deps $PIPX -d "$D" $WHEELS
    local w
    for w in $WHEELS; do
        w=${w%%==*}; w=${w//-/_}
        cp "$D"/"$w"-*.whl "$W"/
    done
    trim_lxml "$W"/lxml-*.whl
    # pystemd: no binary wheel on PyPI; build the cp312 wheel here against Debian 12's libsystemd-dev
    # (252; the host's libsystemd.so.0 is 255, a superset), glibc 2.36 (host: 2.39).
    pip download -q --no-deps --no-binary=:all: -d "$D" "pystemd==$PYSTEMD_VERSION"
    # shellcheck disable=SC2086
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
        --platform any -d "$D" $BUILD_WHEELS
    if [[ -z ${PY312:-} || ! -x $PY312 ]]; then
        log "no CPython 3.12 here (set PY312): carrying only the source fallback for pystemd"
    else
        dpkg -s libsystemd-dev pkg-config >/dev/null 2>&1 || apt-get install -y -q libsystemd-dev pkg-config >/dev/null
        local B; B=$(mktemp -d)
        "$PY312" -m venv "$B/venv"
        # shellcheck disable=SC2086
        "$B"/venv/bin/pip install -q --no-index --find-links "$D" $BUILD_WHEELS
        CFLAGS="-g0 -O2" LDFLAGS="-s" "$B"/venv/bin/pip wheel -q --no-deps --no-build-isolation --no-index \
            -w "$W" "$D"/pystemd-$PYSTEMD_VERSION.tar.gz
        "$B"/venv/bin/pip install -q --no-index --find-links "$W" pystemd
        "$B"/venv/bin/python -c 'import sys, pystemd; from pystemd.dbuslib import DBus, apply_signature; print("pystemd", pystemd.__version__, "imports under", sys.version.split()[0])' >&2
        local so
        command -v objdump >/dev/null || so=skip
        [[ ${so:-} == skip ]] || for so in "$B"/venv/lib/python3.12/site-packages/pystemd/*.so; do
            objdump -T "$so" | grep -oE 'GLIBC_[0-9.]+'
        done | sort -uV | tail -1 | sed 's/^/pystemd needs at most /' >&2
        rm -rf "$B"
    fi
    # fallback: build pystemd ON the GPU host (gcc 13 is there; headers, .pc and pkg-config are not)
    local F=$KIT/pystemd-src
    rm -rf "$F"; mkdir -p "$F/whl" "$F/include" "$F/bin"
    cp "$D"/pystemd-$PYSTEMD_VERSION.tar.gz "$F/"
    cp "$D"/setuptools-*.whl "$D"/wheel-*.whl "$F/whl/"
    rm -rf "$C/stage-dev"; dpkg -x "$(ls "$C"/debs/libsystemd-dev_*.deb)" "$C/stage-dev"
    cp -a "$C"/stage-dev/usr/include/systemd "$F/include/"
    rm -rf "$C/stage-dev"
    cp "$HERE/pystemd_fallback/pkg-config" "$HERE/pystemd_fallback/build.sh" "$F/bin/"
    mv "$F/bin/build.sh" "$F/build.sh"
    chmod +x "$F/bin/pkg-config" "$F/build.sh"
    log "wheels: $(ls "$W" | wc -l) files, $(du -sh "$W" | cut -f1); pystemd fallback $(du -sh "$F" | cut -f1)"
}

trim_lxml() {
    # pystemd needs lxml.etree only: drop objectify, html diff, isoschematron and the C sources/headers
    python3 - "$1" <<'PY'
import base64, hashlib, os, re, sys, zipfile
src = sys.argv[1]; tmp = src + ".tmp"
drop = re.compile(r"^lxml/(objectify\.|html/_difflib\.|html/diff\.|includes/|isoschematron/)|\.(pyx|pxd|pxi|h)$")
zin = zipfile.ZipFile(src)
record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
rows = []
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        n = info.filename
        if n == record_name or drop.search(n):
            continue
        data = zin.read(n)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    rows.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(rows) + "\n")
os.replace(tmp, src)
print(f"lxml trimmed to {os.path.getsize(src)} bytes", file=sys.stderr)
PY
}

pack() {
    local O=$C/carry W
    rm -rf "$O"; mkdir -p "$O"
    # wheels whose exact version the sglang site already carries (pydantic, pydantic-core, ...) stay
    # out of the carried kit: the GPU host puts the site on PYTHONPATH after the daemon's own dir
    local skip=() dist
    if [[ -s $C/sglang/site-lean.tar.xz ]]; then
        cp "$C/sglang/site-lean.tar.xz" "$O/"
        [[ -s $C/sglang/site-extra.tar.xz ]] && cp "$C/sglang/site-extra.tar.xz" "$O/"
        local in_site
        in_site=$(tar -tJf "$C/sglang/site-lean.tar.xz" | sed -n 's|^\./||; s|\.dist-info/METADATA$||p' | tr 'A-Z-' 'a-z_')
        for W in "$KIT"/wheels/*.whl; do
            dist=$(basename "$W" | cut -d- -f1-2 | tr 'A-Z-' 'a-z_')
            grep -qx "$dist" <<<"$in_site" && skip+=(--exclude "wheels/$(basename "$W")")
        done
    fi
    # lxml (`import pystemd` imports pystemd.base, which imports lxml) is packed apart with the
    # pystemd source fallback (kit-fallback.tar.xz): the GPU image's Python has its own lxml, and
    # with it in k26kit the carry passed the device tool's 64 MiB. kit_setup.sh says when a host
    # lacks one. Carry the fallback only if needed.
    skip+=(--exclude "wheels/lxml-*.whl")
    compgen -G "$KIT/wheels/lxml-*.whl" >/dev/null || { log "no lxml wheel in $KIT/wheels: run the wheels step"; exit 1; }
    (cd "$KIT" && XZ_OPT="-9e -T0" tar --owner=0 --group=0 "${skip[@]}" -cJf "$O/k26kit.tar.xz" systemd wheels)
    (cd "$KIT" && XZ_OPT="-9e -T0" tar --owner=0 --group=0 -cJf "$C/kit-fallback.tar.xz" pystemd-src wheels/lxml-*.whl)
    {
        echo "# built $(date -u +%FT%TZ) by bench/gpu/make_kit.sh"
        for f in "$O"/*.tar.xz "$C/kit-fallback.tar.xz"; do
            printf '%s %s bytes (%s MiB) sha256 %s\n' "$(basename "$f")" "$(stat -c %s "$f")" \
                "$(awk -v s="$(stat -c %s "$f")" 'BEGIN{printf "%.2f", s/1048576}')" "$(sha256sum "$f" | cut -c1-16)"
        done
        echo "## debs (kit/systemd)"; cat "$KIT/systemd/VERSIONS"
        echo "## wheels in k26kit.tar.xz"; tar -tJf "$O/k26kit.tar.xz" | sed -n 's|^wheels/\(.\)|\1|p'
        echo "## wheels left out (the same versions are in site-lean.tar.xz; lxml: in kit-fallback.tar.xz)"
        printf '%s\n' "${skip[@]}" | { grep -v -e --exclude -e lxml || true; } | sed 's|^wheels/||'
    } > "$O/MANIFEST.txt"
    cat "$O/MANIFEST.txt" >&2
    local tree total
    tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    total=$(( tree + $(du -cb "$O"/* | tail -1 | cut -f1) ))
    log "carry total with the working tree ($tree bytes): $total bytes ($(awk -v s=$total 'BEGIN{printf "%.2f", s/1048576}') MiB of 64 MiB)"
    # the device tool carries the working tree and `carry` together, at most 64 MiB
    if ((total > 64 * 1048576)); then log "the carry is over 64 MiB: the device tool would refuse it"; exit 1; fi
}

# Debian 12's docker-registry 2.8 (links libc only), for eagle3_real_sglang.py's bundle act. Too
# big for the main carry (4.6 MiB as xz): carried alone, in a second call on the still-warm
# machine (/tmp/site kept): run(..., carry=[".cache/gpu/registry"]), then
# `xz -dc .cache/gpu/registry/docker-registry.xz > /tmp/docker-registry && chmod +x ...`.
registry() {
    local R=$C/registry S=$C/stage-registry
    mkdir -p "$C/debs" "$R"
    compgen -G "$C/debs/docker-registry_*.deb" >/dev/null || (cd "$C/debs" && apt-get download docker-registry)
    rm -rf "$S"; dpkg -x "$(ls "$C"/debs/docker-registry_*.deb)" "$S"
    xz -9e -T0 -c "$S/usr/bin/docker-registry" > "$R/docker-registry.xz"
    rm -rf "$S"
    log "registry: $(du -h "$R/docker-registry.xz" | cut -f1) in $R"
}

steps=("$@"); ((${#steps[@]})) || steps=(all)
for s in "${steps[@]}"; do
    case $s in
        all) site; extra; systemd_kit; wheels; pack ;;
        site) site ;; extra) extra ;; systemd) systemd_kit ;; wheels) wheels ;; pack) pack ;;
        registry) registry ;;
        *) log "unknown step $s"; exit 2 ;;
    esac
done
