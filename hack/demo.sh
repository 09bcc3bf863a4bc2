#!/usr/bin/env bash
# The README's "run it locally" command: starts a local control plane (real
# etcd, kube-apiserver, kube-controller-manager built from Go modules),
# installs the CRDs, applies the sample tasks from examples/ and shows them
# with kubectl. Keeps running until Ctrl-C (or exits at once with
# DEMO_EXIT=1), then stops everything it started.
#
# Stage: the operator runs; the demo workers come with the worker SDK, so
# the tasks wait with their leases Offered.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=demo
. e2e/lib/common.sh
. hack/env.sh

hack/deps.sh
run_dir=$(mktemp -d /tmp/batchlease-demo.XXXXXX)
cleanup() {
  [ -f "$run_dir/operator.pid" ] && kill "$(cat "$run_dir/operator.pid")" 2>/dev/null
  e2e/controlplane/down.sh "$run_dir/cp" || true
  rm -rf "$run_dir"
}
trap cleanup EXIT INT TERM
e2e/controlplane/up.sh "$run_dir/cp" >/dev/null
. "$run_dir/cp/env"

kubectl apply --server-side -f crds/
kubectl wait --for=condition=Established --timeout=60s crd/batchtasks.batchlease.dev crd/taskleases.batchlease.dev
kubectl create namespace demo
cargo build -q -p batchlease-operator
"$CARGO_TARGET_DIR/debug/batchlease-operator" --namespaces=demo --leader-lease-namespace=demo \
  --metrics-addr=127.0.0.1:0 >"$run_dir/operator.log" 2>&1 &
echo $! > "$run_dir/operator.pid"
kubectl apply -n demo -f examples/
kubectl wait -n demo --for=jsonpath='{.status.phase}'=Ready --timeout=60s batchtask --all
echo
kubectl get batchtasks -n demo
kubectl get taskleases -n demo
echo
log "control plane is up. In another shell:"
log "  export KUBECONFIG=$KUBECONFIG PATH=$(dirname "$BATCHLEASE_KUBECTL"):\$PATH"
log "  kubectl get bt,tl -n demo        (operator log: $run_dir/operator.log)"
[ "${DEMO_EXIT:-0}" = 1 ] && exit 0
log "Ctrl-C stops it."
while kill -0 "$(cat "$run_dir/cp/run/kube-apiserver.pid")" 2>/dev/null; do sleep 2; done
