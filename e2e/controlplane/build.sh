#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, the
# kubelet (e2e/node/ runs it), etcd and helm from Go modules into a cache
# outside the repository, keyed by version, and prints the bin directory.
# Each missing binary is built on its own, so adding one to a cached
# directory builds just that one. Skips the build when the binaries are already there, so warm
# runs cost nothing. See e2e/README.md for measured times.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
bin="$cache_root/controlplane/k8s-$KUBE_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION/bin"
mkdir -p "$bin"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
log() { echo "[controlplane/build] $*" >&2; }

need() { for b in "$@"; do [ -x "$bin/$b" ] || return 0; done; return 1; }

k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet)
# The oldest supported version runs no node: no kubelet or scheduler.
[ "${BATCHLEASE_KUBE:-}" = oldest ] && k8s_cmds=(kube-apiserver kube-controller-manager kubectl)
if need "${k8s_cmds[@]}"; then
  # k8s.io/kubernetes cannot be built with `go install`: its go.mod replaces
  # the staging modules with local paths. A small module of our own requires
  # it and replaces every staging module with its published twin.
  work="$cache_root/controlplane/src/kubernetes-$KUBE_VERSION"
  mkdir -p "$work"
  modfile=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  if [ ! -f "$work/go.mod" ]; then
    log "generating $work/go.mod from $modfile"
    ( cd "$work"
      gov=$(sed -n 's/^go \(.*\)/\1/p' "$modfile" | head -1)
      printf 'module batchlease.dev/e2e/controlplane/kubernetes\n\ngo %s\n' "$gov" > go.mod
      grep -E '^godebug' "$modfile" >> go.mod || true
      go mod edit -require="k8s.io/kubernetes@$KUBE_VERSION"
      grep -oE 'k8s.io/[a-z0-9.-]+ => ./staging' "$modfile" | awk '{print $1}' | sort -u | while read -r m; do
        go mod edit -replace="$m=$m@$KUBE_STAGING_VERSION"
      done
      printf 'package main\n' > doc.go
    )
  fi
  # Staging modules the proxy does not serve at KUBE_STAGING_VERSION, taken
  # at a neighbouring patch release (versions.env says which and why).
  for r in ${KUBE_EXTRA_REPLACES:-}; do ( cd "$work" && go mod edit -replace="$r" ); done
  minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
  ld="-s -w"
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld="$ld -X $p.gitVersion=$KUBE_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
  done
  for c in "${k8s_cmds[@]}"; do
    [ -x "$bin/$c" ] && continue
    log "building $c $KUBE_VERSION (cold: tens of minutes on 2 cores)"
    ( cd "$work" && go build -trimpath -ldflags "$ld" -o "$bin/$c.tmp" "k8s.io/kubernetes/cmd/$c" && mv "$bin/$c.tmp" "$bin/$c" )
  done
fi

# etcd and helm of the same versions may be cached beside another
# Kubernetes version's binaries (BATCHLEASE_KUBE=oldest): copied, not rebuilt.
for b in etcd helm; do
  [ -x "$bin/$b" ] && continue
  for other in "$cache_root"/controlplane/k8s-*-etcd-"$ETCD_VERSION"-helm-"$HELM_VERSION"/bin/"$b"; do
    [ -x "$other" ] && cp "$other" "$bin/$b.tmp" && mv "$bin/$b.tmp" "$bin/$b" && break
  done
done

if need etcd; then
  work="$cache_root/controlplane/src/etcd-$ETCD_VERSION"
  mkdir -p "$work"
  if [ ! -f "$work/go.mod" ]; then
    ( cd "$work"
      printf 'module batchlease.dev/e2e/controlplane/etcd\n\ngo 1.26.0\n' > go.mod
      go mod edit -require="go.etcd.io/etcd/server/v3@$ETCD_VERSION"
      printf 'package main\n' > doc.go )
  fi
  log "building etcd $ETCD_VERSION"
  ( cd "$work" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd.tmp" go.etcd.io/etcd/server/v3 && mv "$bin/etcd.tmp" "$bin/etcd" )
fi

if need helm; then
  log "building helm $HELM_VERSION"
  GOBIN="$bin" GOFLAGS= go install -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
fi
echo "$bin"
