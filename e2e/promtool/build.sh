#!/usr/bin/env bash
# Builds promtool (Prometheus's rule checker and rule unit-test runner) from
# its Go module into a cache outside the repository, keyed by version, and
# prints the bin directory. A no-op when cached, so warm runs cost nothing.
# Cold: about 6 minutes on 2 cores (337 s measured, most of it compiling
# the service-discovery SDKs promtool links in).
set -euo pipefail
# Prometheus 3.x is published as Go module versions v0.3MM.P (v3.16.0 is
# v0.316.0): the v3 tags are not valid Go module versions.
PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-v0.316.0}
cache_root=${BATCHLEASE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batchlease}
bin="$cache_root/promtool/prometheus-$PROMETHEUS_VERSION/bin"
mkdir -p "$bin"
if [ ! -x "$bin/promtool" ]; then
  echo "[promtool/build] building promtool $PROMETHEUS_VERSION" >&2
  # go install puts the binary in place only once it linked: an
  # interrupted build leaves no half-written promtool behind.
  CGO_ENABLED=0 GOTOOLCHAIN=${GOTOOLCHAIN:-local} GOFLAGS= GOBIN="$bin" \
    go install -trimpath -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
fi
echo "$bin"
