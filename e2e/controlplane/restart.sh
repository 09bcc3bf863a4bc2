#!/usr/bin/env bash
# Restarts one component of the control plane under STATE_DIR with the
# same command line (ports, certificates, data): the fault a test injects
# to see its clients ride over an API server or etcd restart.
#   restart.sh STATE_DIR etcd|kube-apiserver|kube-controller-manager|kube-scheduler [DOWN_SECONDS]
# DOWN_SECONDS (default 0) keeps the component stopped that long first.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=controlplane
. "$here/../lib/common.sh"
state=${1:?usage: restart.sh STATE_DIR COMPONENT [DOWN_SECONDS]}
name=${2:?usage: restart.sh STATE_DIR COMPONENT [DOWN_SECONDS]}
down=${3:-0}
[ -f "$state/run/$name.cmd" ] || die "no recorded command for $name in $state/run"
stop_pidfile "$state/run/$name.pid"
log "$name stopped"
# The outage the caller asked for (a deliberate fault, not a wait for a
# condition).
[ "$down" = 0 ] || sleep "$down"
bash -c "exec $(cat "$state/run/$name.cmd")" >>"$state/logs/$name.log" 2>&1 &
echo $! > "$state/run/$name.pid"
. "$state/run/ready.sh"
wait_until "$name (restarted)" 120 "$state/logs/$name.log" "${name}_ready"
