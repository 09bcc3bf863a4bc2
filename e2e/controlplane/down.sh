#!/usr/bin/env bash
# Stops what up.sh started under STATE_DIR and removes its data.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=controlplane
. "$here/../lib/common.sh"
state=${1:?usage: down.sh STATE_DIR}
for c in kube-scheduler kube-controller-manager kube-apiserver etcd; do
  stop_pidfile "$state/run/$c.pid"
done
rm -rf "$state/etcd"
log "down: $state"
