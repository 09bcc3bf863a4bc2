#!/usr/bin/env bash
# Builds what a node needs besides the kubelet (e2e/controlplane/build.sh
# builds that) into a cache outside the repository, keyed by version, and
# prints the bin directory (a no-op when cached):
#   containerd, containerd-shim-runc-v2, ctr   from their Go module
#   pause.oci.tar   the pod sandbox image, batchlease.local/pause:<tag>:
#                   kubernetes's own build/pause/linux/pause.c compiled
#                   statically and packed by hack/oci-archive.py, so no
#                   sandbox image is ever pulled (the name resolves nowhere)
#   cni/bridge, cni/host-local, cni/loopback
#                   the pod network's CNI plugins, from their Go module
# runc comes from e2e/oci/build.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# shellcheck source=../controlplane/versions.env
. "$here/../controlplane/versions.env"
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
bin="$cache_root/node/containerd-$CONTAINERD_VERSION-pause-$PAUSE_TAG-k8s-$KUBE_VERSION-cni-$CNI_PLUGINS_VERSION/bin"
mkdir -p "$bin/cni"
export GOTOOLCHAIN=local
log() { echo "[node/build] $*" >&2; }

for c in containerd containerd-shim-runc-v2 ctr; do
  [ -x "$bin/$c" ] && continue
  log "building $c $CONTAINERD_VERSION"
  # No cgo: the btrfs snapshotter (cgo, needs btrfs headers) is left out;
  # the node uses the overlayfs snapshotter.
  GOBIN="$bin" CGO_ENABLED=0 GOFLAGS= go install -trimpath \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/$c@$CONTAINERD_VERSION"
done

for p in main/bridge ipam/host-local main/loopback; do
  [ -x "$bin/cni/${p#*/}" ] && continue
  log "building the CNI plugin ${p#*/} $CNI_PLUGINS_VERSION"
  GOBIN="$bin/cni" CGO_ENABLED=0 GOFLAGS= go install -trimpath -ldflags "-s -w" \
    "github.com/containernetworking/plugins/plugins/$p@$CNI_PLUGINS_VERSION"
done

if [ ! -f "$bin/pause.oci.tar" ]; then
  log "building the pause image $PAUSE_TAG from k8s.io/kubernetes@$KUBE_VERSION"
  src=$(GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  [ -f "$src/build/pause/linux/pause.c" ] || { log "no build/pause/linux/pause.c in $src"; exit 1; }
  work=$(mktemp -d)
  mkdir -p "$work/pause"
  # The flags of build/pause/Makefile.
  gcc -Os -Wall -Werror -static "-DVERSION=v$PAUSE_TAG-k8s-$KUBE_VERSION" \
    -o "$work/pause/pause" "$src/build/pause/linux/pause.c"
  strip "$work/pause/pause"
  printf '{"User": "65535:65535", "Entrypoint": ["/pause"]}\n' > "$work/config.json"
  python3 "$here/../../hack/oci-archive.py" --out "$bin/pause.oci.tar.tmp" \
    --ref "batchlease.local/pause:$PAUSE_TAG" --created 0 \
    --config "$work/config.json" --layer "$work/pause" >/dev/null
  mv "$bin/pause.oci.tar.tmp" "$bin/pause.oci.tar"
  rm -rf "$work"
fi
echo "$bin"
