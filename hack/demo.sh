#!/usr/bin/env bash
# The README's "run it locally" command: starts a local control plane (real
# etcd, kube-apiserver, kube-controller-manager built from Go modules),
# installs the CRDs, applies the sample tasks from examples/ and shows them
# with kubectl. Keeps running until Ctrl-C (or exits at once with
# DEMO_EXIT=1), then stops everything it started.
#
# Stage: the operator and the demo workers are not built yet (issues 3 and
# 4); until then the tasks stay without status.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=demo
. e2e/lib/common.sh
. hack/env.sh

hack/deps.sh
run_dir=$(mktemp -d /tmp/batchlease-demo.XXXXXX)
cleanup() { e2e/controlplane/down.sh "$run_dir/cp" || true; rm -rf "$run_dir"; }
trap cleanup EXIT INT TERM
e2e/controlplane/up.sh "$run_dir/cp" >/dev/null
. "$run_dir/cp/env"

kubectl apply --server-side -f crds/
kubectl wait --for=condition=Established --timeout=60s crd/batchtasks.batchlease.dev crd/taskleases.batchlease.dev
kubectl create namespace demo
kubectl apply -n demo -f examples/
echo
kubectl get batchtasks -n demo
kubectl get taskleases -n demo
echo
log "control plane is up. In another shell:"
log "  export KUBECONFIG=$KUBECONFIG PATH=$(dirname "$BATCHLEASE_KUBECTL"):\$PATH"
log "  kubectl get bt,tl -n demo"
[ "${DEMO_EXIT:-0}" = 1 ] && exit 0
log "Ctrl-C stops it."
while kill -0 "$(cat "$run_dir/cp/run/kube-apiserver.pid")" 2>/dev/null; do sleep 2; done
