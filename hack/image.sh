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
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
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

# The base layer from Debian's packages, cached by their versions. The
# binaries link only libc, libm and libgcc_s (rustls: no OpenSSL; the API
# server's CA comes from the kubeconfig or the pod's service-account mount).
packages=(libc6 libgcc-s1 base-files netbase)
# The versions apt would install now (at least those the binaries were
# linked against on this Debian host); a fresh machine may need the lists.
candidates() { apt-cache policy "${packages[@]}" 2>/dev/null | awk '/^[^ ]/ {p=$1} /Candidate:/ {sub(":$","",p); print p "=" $2}' | sort; }
versions=$(candidates | tr '\n' ' ')
if [ -z "$versions" ] || [[ $versions == *"(none)"* ]] || [ "$(wc -w <<<"$versions")" != "${#packages[@]}" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  versions=$(candidates | tr '\n' ' ')
fi
key=$(printf '%s' "$versions" | sha256sum | cut -c1-16)
base="$cache_root/image-base/$key"
if [ ! -d "$base/rootfs" ]; then
  log "assembling the base layer from Debian packages: $versions"
  tmp=$(mktemp -d)
  pins=(); for p in $versions; do pins+=("$p"); done
  ( cd "$tmp" && apt-get download -qq "${pins[@]}" )
  r="$tmp/rootfs"
  mkdir -p "$r/var/lib/dpkg/status.d"
  for deb in "$tmp"/*.deb; do
    dpkg-deb -x "$deb" "$r"
    # Where image scanners (syft, trivy) find a distroless image's packages.
    dpkg-deb -f "$deb" > "$r/var/lib/dpkg/status.d/$(dpkg-deb -f "$deb" Package)"
  done
  # Keep the licences, drop the rest of the documentation.
  find "$r/usr/share/doc" -type f ! -name copyright -delete 2>/dev/null || true
  rm -rf "$r/usr/share/man" "$r/usr/share/info" "$r/usr/share/lintian" "$r/usr/share/locale"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$r/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$r/etc/group"
  mkdir -p "$r/home/nonroot" "$r/tmp" "$r/root"
  chmod 1777 "$r/tmp"; chmod 0700 "$r/root"
  mkdir -p "$base" && mv "$r" "$base/rootfs" && rm -rf "$tmp"
fi

mkdir -p "$out"
for bin in batchlease-operator batchlease-demo-worker batchlease-run; do
  case $bin in
    batchlease-operator) desc="batchlease operator: runs BatchTasks with fenced, renewable TaskLeases" ;;
    batchlease-demo-worker) desc="batchlease demo worker: runs the sample BatchTasks with fenced PostgreSQL commits" ;;
    batchlease-run) desc="batchlease-run: runs any command as a batchlease worker, one process group per attempt under the kill switch" ;;
  esac
  work=$(mktemp -d)
  mkdir -p "$work/app/usr/local/bin"
  install -m 0755 "$bindir/$bin" "$work/app/usr/local/bin/$bin"
  python3 - "$work/config.json" <<PY
import json, sys
labels = {
    "org.opencontainers.image.title": "$bin",
    "org.opencontainers.image.description": "$desc",
    "org.opencontainers.image.version": "$version",
    "org.opencontainers.image.revision": "$revision",
    "org.opencontainers.image.source": "$source_url",
    "org.opencontainers.image.url": "$source_url",
    "org.opencontainers.image.licenses": "Apache-2.0",
    "org.opencontainers.image.vendor": "batchlease",
    "org.opencontainers.image.created": __import__("time").strftime("%Y-%m-%dT%H:%M:%SZ", __import__("time").gmtime($created)),
    "org.opencontainers.image.base.name": "debian:bookworm ($versions)".replace(" )", ")"),
    "dev.batchlease.build.profile": "$profile",
}
json.dump({
    "User": "65532:65532",
    "Entrypoint": ["/usr/local/bin/$bin"],
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
    "WorkingDir": "/",
    "Labels": labels,
}, open(sys.argv[1], "w"), indent=1)
PY
  # Layer directories are named for the image's history.
  ln -s "$base/rootfs" "$work/debian-bookworm-base"
  mv "$work/app" "$work/$bin"
  python3 hack/oci-archive.py --out "$out/$bin-$version.oci.tar" --ref "$registry/$bin:$version" \
    --created "$created" --config "$work/config.json" \
    --layer "$work/debian-bookworm-base/" --layer "$work/$bin" \
    --owner /home/nonroot=65532:65532 >/dev/null
  rm -rf "$work"
  log "$out/$bin-$version.oci.tar  ($registry/$bin:$version, $(du -h "$out/$bin-$version.oci.tar" | cut -f1))"
  echo "$out/$bin-$version.oci.tar"
done
