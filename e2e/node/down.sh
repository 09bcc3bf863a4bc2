#!/usr/bin/env bash
# Stops the node up.sh started under STATE_DIR: the kubelet, then every
# container containerd runs there (their shims outlive both), then
# containerd; unmounts what they mounted under STATE_DIR and removes their
# data (the logs stay). Safe after a failed start or twice.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=node
. "$here/../lib/common.sh"
state=${1:?usage: down.sh STATE_DIR}
[ -d "$state" ] || exit 0
state=$(cd "$state" && pwd)
sock=$state/run/containerd.sock
stop_pidfile "$state/run/kubelet.pid"
ctr_bin=$(sed -n 's/^export BATCHLEASE_CTR=//p' "$state/env" 2>/dev/null)
# No env file: up.sh failed before writing it; its ctr is in the cache.
[ -n "$ctr_bin" ] || ctr_bin=$("$here/build.sh" 2>/dev/null)/ctr
[ -x "$ctr_bin" ] || ctr_bin=""
if [ -n "$ctr_bin" ] && [ -S "$sock" ]; then
  ctr() { timeout 20 "$ctr_bin" --address "$sock" -n k8s.io "$@"; }
  for t in $(ctr tasks ls -q 2>/dev/null); do
    ctr tasks kill -s SIGKILL "$t" >/dev/null 2>&1
  done
  for t in $(ctr tasks ls -q 2>/dev/null); do
    ctr tasks delete -f "$t" >/dev/null 2>&1
  done
  for c in $(ctr containers ls -q 2>/dev/null); do
    ctr containers delete "$c" >/dev/null 2>&1
  done
fi
stop_pidfile "$state/run/containerd.pid"
# Shims still running for this containerd (named by its socket on their
# command line), by process id.
for p in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null) || continue
  case $cmd in
    *containerd-shim-runc-v2*"$sock"*) kill -KILL "${p#/proc/}" 2>/dev/null ;;
  esac
done
# Mounts under STATE_DIR (pod volumes, container root filesystems), the
# deepest first.
awk -v d="$state/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r |
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
# The pod network's bridge (the pods' veths went with their namespaces)
# and its address leases.
if [ -f "$state/run/pod-bridge" ]; then
  ip link del "$(cat "$state/run/pod-bridge")" 2>/dev/null
  rm -f "$state/run/pod-bridge"
fi
rm -rf "$state/containerd/root" "$state/containerd/state" "$state/kubelet" "$state/cni/ipam" 2>/dev/null
log "down: $state"
