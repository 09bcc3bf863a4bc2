#!/usr/bin/env bash
# Builds the OCI tools of the image tests from Go modules into a cache outside
# the repository, keyed by version, and prints the bin directory (a no-op when
# cached):
#   runc   the OCI runtime that runs the operator's image (e2e/tests/image.rs)
#   crane  go-containerregistry's CLI: validates the image archives the way
#          `docker load` reads them
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
bin="$cache_root/oci/runc-$RUNC_VERSION-crane-$CRANE_VERSION/bin"
mkdir -p "$bin"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
log() { echo "[oci/build] $*" >&2; }

if [ ! -x "$bin/runc" ]; then
  # runc needs cgo (its nsexec is C). Its go.mod replaces
  # github.com/opencontainers/selinux with a nested module that the module
  # zip leaves out, so `go install` refuses it; build a copy of the module
  # without that replace (the published selinux it pins instead). No build
  # tags: no seccomp (libseccomp is not needed; the test's spec sets no
  # seccomp profile).
  log "building runc $RUNC_VERSION"
  src=$(go mod download -json "github.com/opencontainers/runc@$RUNC_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  work="$cache_root/oci/src/runc-$RUNC_VERSION"
  rm -rf "$work" && mkdir -p "$(dirname "$work")" && cp -r "$src" "$work" && chmod -R u+w "$work"
  ( cd "$work"
    go mod edit -dropreplace=github.com/opencontainers/selinux
    CGO_ENABLED=1 go build -trimpath -ldflags "-s -w -X main.version=${RUNC_VERSION#v}" -o "$bin/runc.tmp" .
    mv "$bin/runc.tmp" "$bin/runc" )
fi

if [ ! -x "$bin/crane" ]; then
  log "building crane $CRANE_VERSION"
  GOBIN="$bin" CGO_ENABLED=0 GOFLAGS= go install -trimpath -ldflags "-s -w" \
    "github.com/google/go-containerregistry/cmd/crane@$CRANE_VERSION"
fi
echo "$bin"
