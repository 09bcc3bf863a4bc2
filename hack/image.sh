#!/usr/bin/env bash
# Builds the batchlease container images as OCI image archives, without a
# container daemon: the same images as the Dockerfile (a Debian bookworm C
# runtime — libc6, libgcc-s1, base-files, netbase — plus one binary, run as
# 65532:65532), assembled from Debian's packages and the release binaries.
#
#   hack/image.sh [--profile release|debug] [--out DIR] [--registry PREFIX]
#
# Writes, and prints the paths of:
#   DIR/batchlease-operator-<version>.oci.tar     PREFIX/batchlease-operator:<version>
#   DIR/batchlease-demo-worker-<version>.oci.tar  PREFIX/batchlease-demo-worker:<version>
#   DIR/batchlease-run-<version>.oci.tar          PREFIX/batchlease-run:<version>
#     (no shell in it: copy its binary into an image that has your command,
#     see docs/batchlease-run.md)
#   DIR/batchlease-python-worker-<version>.oci.tar  PREFIX/batchlease-python-worker:<version>
#     (examples/python-worker on Debian's python3.11, the batchlease wheel and
#     psycopg in /app/site-packages; needs python3 with venv and PyPI for
#     psycopg, cached in $BATCHLEASE_CACHE after the first build)
# (DIR defaults to $CARGO_TARGET_DIR/images, outside the repository; PREFIX to
# ghcr.io/batchlease, which with the crate version is what the chart deploys
# by default). Each archive is an OCI image layout that also carries Docker's
# manifest.json:
#   docker load -i FILE            kind load image-archive FILE
#   ctr -n k8s.io images import FILE   podman load -i FILE
# --profile debug packs the debug binaries (CI does, to save a release
# build; the label dev.batchlease.build.profile says which).
# Reproducible: file times and the `created` field are the commit's time
# (or SOURCE_DATE_EPOCH).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=image
. e2e/lib/common.sh
. hack/env.sh

profile=release out="$CARGO_TARGET_DIR/images" registry=ghcr.io/batchlease
while (($#)); do
  case $1 in
    --profile) profile=$2; shift 2 ;;
    --profile=*) profile=${1#*=}; shift ;;
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --registry) registry=$2; shift 2 ;;
    --registry=*) registry=${1#*=}; shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
case $profile in release|debug) ;; *) die "--profile must be release or debug" ;; esac
command -v dpkg-deb >/dev/null || die "dpkg-deb (Debian's dpkg) is required"
command -v python3 >/dev/null || die "python3 is required"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain 2>/dev/null)" ] || revision="$revision-dirty"
created=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
source_url=$(sed -n 's/^repository = "\(.*\)"/\1/p' Cargo.toml | head -1)

log "building the $profile binaries"
flags=(--locked -p batchlease-operator -p batchlease-demo-worker -p batchlease-run)
[ "$profile" = release ] && flags+=(--release)
cargo build -q "${flags[@]}"
bindir="$CARGO_TARGET_DIR/$profile"

# A root filesystem from pinned Debian packages, cached by their versions:
#   debian_layer KIND PACKAGE… → sets $layer_dir (…/rootfs) and $layer_versions
# The versions are the ones apt would install now (at least those the
# binaries were linked against on this Debian host); a fresh machine may need
# the lists. Each package's control file goes to /var/lib/dpkg/status.d,
# where image scanners (syft, trivy) find a distroless image's packages.
candidates() { apt-cache policy "$@" 2>/dev/null | awk '/^[^ ]/ {p=$1} /Candidate:/ {sub(":$","",p); print p "=" $2}' | sort; }
debian_layer() {
  local kind=$1; shift
  local versions
  versions=$(candidates "$@" | tr '\n' ' ')
  if [ -z "$versions" ] || [[ $versions == *"(none)"* ]] || [ "$(wc -w <<<"$versions")" != "$#" ]; then
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    versions=$(candidates "$@" | tr '\n' ' ')
  fi
  layer_versions=$versions
  # The base's key is its versions alone (as before: existing caches stay good).
  local key
  key=$(printf '%s' "$versions" | sha256sum | cut -c1-16)
  layer_dir="$cache_root/image-$kind/$key/rootfs"
  [ -d "$layer_dir" ] && return 0
  log "assembling the $kind layer from Debian packages: $versions"
  local tmp r deb pins=()
  tmp=$(mktemp -d)
  for p in $versions; do pins+=("$p"); done
  ( cd "$tmp" && apt-get download -qq "${pins[@]}" )
  r="$tmp/rootfs"
  mkdir -p "$r/var/lib/dpkg/status.d"
  for deb in "$tmp"/*.deb; do
    dpkg-deb -x "$deb" "$r"
    dpkg-deb -f "$deb" > "$r/var/lib/dpkg/status.d/$(dpkg-deb -f "$deb" Package)"
  done
  # Keep the licences, drop the rest of the documentation.
  find "$r/usr/share/doc" -type f ! -name copyright -delete 2>/dev/null || true
  rm -rf "$r/usr/share/man" "$r/usr/share/info" "$r/usr/share/lintian" "$r/usr/share/locale"
  if [ "$kind" = base ]; then
    printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$r/etc/passwd"
    printf 'root:x:0:\nnonroot:x:65532:\n' > "$r/etc/group"
    mkdir -p "$r/home/nonroot" "$r/tmp" "$r/root"
    chmod 1777 "$r/tmp"; chmod 0700 "$r/root"
  fi
  mkdir -p "${layer_dir%/rootfs}" && mv "$r" "$layer_dir" && rm -rf "$tmp"
}

# The base layer. The binaries link only libc, libm and libgcc_s (rustls: no
# OpenSSL; the API server's CA comes from the kubeconfig or the pod's
# service-account mount).
debian_layer base libc6 libgcc-s1 base-files netbase
base=${layer_dir%/rootfs}
versions=$layer_versions

# The Python worker's runtime on top of it: Debian's CPython 3.11 and the
# shared libraries its interpreter and stdlib extension modules load, listed
# rather than resolved with `apt-cache depends --recurse`, which also pulls in
# what only the packages' maintainer scripts use (perl, dpkg, tar,
# mime-support → mailcap → perl) and libgdbm (the _gdbm module is in
# python3-gdbm, not installed). libtirpc3 (for _nis via libnsl2) brings
# Kerberos; media-types is the mimetypes module's /etc/mime.types.
debian_layer python \
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib \
  libexpat1 zlib1g libssl3 libbz2-1.0 libcrypt1 libdb5.3 libffi8 liblzma5 \
  libncursesw6 libtinfo6 libreadline8 libsqlite3-0 libuuid1 media-types \
  libnsl2 libtirpc3 libtirpc-common libgssapi-krb5-2 libk5crypto3 \
  libkeyutils1 libkrb5-3 libkrb5support0 libcom-err2
python_layer=$layer_dir
python_versions=$layer_versions

# /app/site-packages: psycopg from PyPI (manylinux wheels for CPython 3.11,
# whatever this host's Python is), cached by its pin; the batchlease wheel
# (abi3, built by python/test.sh into $CARGO_TARGET_DIR/python-wheels, in
# release mode for a release image) on top at each build.
log "building the batchlease Python wheel ($profile)"
py_release=""; [ "$profile" = release ] && py_release=1
venv_py=$(BATCHLEASE_PY_RELEASE=$py_release python/test.sh --build-only)
# The version python/test.sh tests the package with.
py_deps='psycopg[binary]==3.3.9'
# Every manylinux tag up to bookworm's glibc (2.36) that wheels use: pip
# before 24 takes --platform literally.
py_platform="--python-version 3.11 --implementation cp --only-binary=:all:"
py_platform+=" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
deps_key=$(printf '%s %s' "$py_deps" "$py_platform" | sha256sum | cut -c1-16)
deps_dir="$cache_root/image-python-deps/$deps_key/rootfs"
if [ ! -d "$deps_dir" ]; then
  log "installing $py_deps for the image"
  tmp=$(mktemp -d)
  # --no-compile: no .pyc (they would hold build-time mtimes; the root is
  # read-only and PYTHONDONTWRITEBYTECODE=1, so they are never written).
  # shellcheck disable=SC2086
  PIP_CACHE_DIR=$cache_root/pip "$(dirname "$venv_py")/pip" install -q --no-compile \
    --target "$tmp/rootfs/app/site-packages" $py_platform "$py_deps"
  mkdir -p "${deps_dir%/rootfs}" && mv "$tmp/rootfs" "$deps_dir" && rm -rf "$tmp"
fi

mkdir -p "$out"
# pack NAME DESCRIPTION PACKAGES CONFIG_JSON DIR=LAYER…: the OCI archive of
# image NAME; PACKAGES are the Debian package versions in it (its base.name
# label), CONFIG_JSON holds its Entrypoint and Env, the rest is common. Each
# layer is DIR packed under the name LAYER (the image's history shows it).
pack() {
  local name=$1 desc=$2 pkgs=$3 cfg=$4; shift 4
  local work layers=() d
  work=$(mktemp -d)
  NAME=$name DESC=$desc CFG=$cfg BASE_NAME="debian:bookworm ($(echo $pkgs))" python3 - "$work/config.json" <<PY
import json, os, sys, time
labels = {
    "org.opencontainers.image.title": os.environ["NAME"],
    "org.opencontainers.image.description": os.environ["DESC"],
    "org.opencontainers.image.version": "$version",
    "org.opencontainers.image.revision": "$revision",
    "org.opencontainers.image.source": "$source_url",
    "org.opencontainers.image.url": "$source_url",
    "org.opencontainers.image.licenses": "Apache-2.0",
    "org.opencontainers.image.vendor": "batchlease",
    "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime($created)),
    "org.opencontainers.image.base.name": os.environ["BASE_NAME"],
    "dev.batchlease.build.profile": "$profile",
}
json.dump({
    "User": "65532:65532",
    "WorkingDir": "/",
    **json.loads(os.environ["CFG"]),
    "Labels": labels,
}, open(sys.argv[1], "w"), indent=1)
PY
  for d in "$@"; do
    ln -s "${d%%=*}" "$work/${d#*=}"
    layers+=(--layer "$work/${d#*=}/")
  done
  python3 hack/oci-archive.py --out "$out/$name-$version.oci.tar" --ref "$registry/$name:$version" \
    --created "$created" --config "$work/config.json" "${layers[@]}" \
    --owner /home/nonroot=65532:65532 >/dev/null
  rm -rf "$work"
  log "$out/$name-$version.oci.tar  ($registry/$name:$version, $(du -h "$out/$name-$version.oci.tar" | cut -f1))"
  echo "$out/$name-$version.oci.tar"
}

for bin in batchlease-operator batchlease-demo-worker batchlease-run; do
  case $bin in
    batchlease-operator) desc="batchlease operator: runs BatchTasks with fenced, renewable TaskLeases" ;;
    batchlease-demo-worker) desc="batchlease demo worker: runs the sample BatchTasks with fenced PostgreSQL commits" ;;
    batchlease-run) desc="batchlease-run: runs any command as a batchlease worker, one process group per attempt under the kill switch" ;;
  esac
  app=$(mktemp -d)
  install -D -m 0755 "$bindir/$bin" "$app/usr/local/bin/$bin"
  pack "$bin" "$desc" "$versions" \
    "{\"Entrypoint\": [\"/usr/local/bin/$bin\"], \"Env\": [\"PATH=/usr/local/bin:/usr/bin:/bin\"]}" \
    "$base/rootfs=debian-bookworm-base" "$app=$bin"
  rm -rf "$app"
done

# The Python example worker (examples/python-worker; its Dockerfile builds
# the same image with docker). PYTHONPATH rather than a venv: nothing to
# activate, and the interpreter stays Debian's.
app=$(mktemp -d)
install -D -m 0644 examples/python-worker/worker.py "$app/app/worker.py"
"$(dirname "$venv_py")/pip" install -q --no-compile --no-deps \
  --target "$app/app/site-packages" "$CARGO_TARGET_DIR"/python-wheels/batchlease-*.whl
# It records the wheel's path on this machine: not reproducible, not useful.
rm -f "$app"/app/site-packages/batchlease-*.dist-info/direct_url.json
chmod -R a+rX "$app"
pack batchlease-python-worker \
  "batchlease Python worker: the examples/python-worker worker on Debian's CPython 3.11 with the batchlease package" \
  "$versions $python_versions" \
  '{"Entrypoint": ["/usr/bin/python3.11", "/app/worker.py"], "Env": ["PATH=/usr/bin:/bin", "PYTHONPATH=/app/site-packages", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1"]}' \
  "$base/rootfs=debian-bookworm-base" "$python_layer=debian-bookworm-python3.11" \
  "$deps_dir=python-dependencies" "$app=batchlease-python-worker"
rm -rf "$app"
