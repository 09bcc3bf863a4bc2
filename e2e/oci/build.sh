#!/usr/bin/env bash
# Builds the OCI tools of the image tests from Go modules into a cache outside
# the repository, keyed by version, and prints the bin directory (a no-op when
# cached):
#   runc   the OCI runtime that runs the operator's image (e2e/tests/image.rs)
#          and, under containerd, the node's pods (e2e/node/); with seccomp
#   crane  go-containerregistry's CLI: validates the image archives the way
#          `docker load` reads them
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
# "seccomp" in the key: runc built before it had no seccomp support, and a
# kubelet's pods ask for a profile (RuntimeDefault).
bin="$cache_root/oci/runc-$RUNC_VERSION-seccomp-crane-$CRANE_VERSION/bin"
mkdir -p "$bin"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
log() { echo "[oci/build] $*" >&2; }

if [ ! -x "$bin/runc" ]; then
  # runc needs cgo (its nsexec is C). Its go.mod replaces
  # github.com/opencontainers/selinux with a nested module that the module
  # zip leaves out, so `go install` refuses it; build a copy of the module
  # without that replace (the published selinux it pins instead). Built
  # with the seccomp tag against libseccomp (Debian's libseccomp-dev,
  # hack/deps.sh installs it): pods started by the kubelet under containerd
  # carry a seccomp profile (the chart's RuntimeDefault), and a runc
  # without seccomp refuses them ("seccomp not supported").
  log "building runc $RUNC_VERSION"
  src=$(go mod download -json "github.com/opencontainers/runc@$RUNC_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  work="$cache_root/oci/src/runc-$RUNC_VERSION"
  pkg-config --exists libseccomp 2>/dev/null || [ -f /usr/include/seccomp.h ] ||
    { echo "[oci/build] libseccomp headers missing: install Debian's libseccomp-dev (hack/deps.sh does)" >&2; exit 1; }
  rm -rf "$work" && mkdir -p "$(dirname "$work")" && cp -r "$src" "$work" && chmod -R u+w "$work"
  ( cd "$work"
    go mod edit -dropreplace=github.com/opencontainers/selinux
    CGO_ENABLED=1 go build -trimpath -tags seccomp -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" -o "$bin/runc.tmp" .
    mv "$bin/runc.tmp" "$bin/runc" )
fi

if [ ! -x "$bin/crane" ]; then
  log "building crane $CRANE_VERSION"
  GOBIN="$bin" CGO_ENABLED=0 GOFLAGS= go install -trimpath -ldflags "-s -w" \
    "github.com/google/go-containerregistry/cmd/crane@$CRANE_VERSION"
fi
echo "$bin"
