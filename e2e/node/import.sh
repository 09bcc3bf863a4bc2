#!/usr/bin/env bash
# Imports image archives (hack/image.sh's) into the node under STATE_DIR
# (up.sh), where the kubelet's pods find them: containerd's k8s.io
# namespace, unpacked for its snapshotter. Nothing is pulled.
#   import.sh STATE_DIR ARCHIVE...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=node
. "$here/../lib/common.sh"
state=${1:?usage: import.sh STATE_DIR ARCHIVE...}; shift
[ -f "$state/env" ] || die "no node in $state (up.sh writes $state/env)"
. "$state/env"
for a in "$@"; do
  # (ctr warns that cgroup v1 is deprecated on every call: not news.)
  if ! "$BATCHLEASE_CTR" --address "$BATCHLEASE_CONTAINERD_ADDRESS" -n k8s.io images import "$a" 2>&1 >/dev/null |
    { grep -v 'DEPRECATION: The support for cgroup v1' >&2 || true; }; then
    die "importing $a failed"
  fi
  log "imported $(basename "$a")"
done
