#!/usr/bin/env bash
# The README's "run it locally" command: starts a local control plane (real
# etcd, kube-apiserver, kube-controller-manager built from Go modules), a
# throwaway PostgreSQL, the operator and two demo workers, applies the sample
# tasks from examples/ and shows them finishing. Keeps running until Ctrl-C
# (or exits once the tasks are done with DEMO_EXIT=1), then stops everything.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=demo
. e2e/lib/common.sh
. hack/env.sh
. hack/local-env.sh

hack/deps.sh
cargo build -q -p batchlease-operator -p batchlease-demo-worker
bin=$CARGO_TARGET_DIR/debug
run_dir=$(mktemp -d /tmp/batchlease-demo.XXXXXX)
pids=()
cleanup() {
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  local_env_down "$run_dir"
  rm -rf "$run_dir"
}
trap cleanup EXIT INT TERM
local_env_up "$run_dir"

kubectl apply --server-side -f crds/
kubectl wait --for=condition=Established --timeout=60s \
  crd/batchtasks.batchlease.dev crd/taskleases.batchlease.dev crd/taskqueues.batchlease.dev \
  crd/workerleases.batchlease.dev
kubectl create namespace demo
"$bin/batchlease-operator" --namespaces=demo --leader-lease-namespace=demo \
  --metrics-addr=127.0.0.1:0 >"$run_dir/operator.log" 2>&1 &
pids+=($!)
# Two workers started together on an empty database: both migrate (the SDK
# serialises migrations with an advisory lock) and both claim tasks — the
# `worker` column of the task_state query below shows which one committed
# each task. Identities are <name>/<suffix>, the form the chart's holder-only
# admission policy expects (the SDK warns about any other).
for w in 1 2; do
  "$bin/batchlease-demo-worker" --namespace=demo --queues=demo --slots=2 --identity="demo-worker-$w/0$w" \
    >"$run_dir/worker-$w.log" 2>&1 &
  pids+=($!)
done
kubectl apply -n demo -f examples/
log "waiting for the sample tasks (a flaky one may retry)…"
kubectl wait -n demo --for=jsonpath='{.status.phase}'=Succeeded --timeout=180s batchtask --all || true
echo
kubectl get batchtasks -n demo
kubectl get taskleases -n demo
kubectl get leases -n demo -l batchlease.dev/lock-namespace=demo   # resource locks (examples/pipeline.yaml)
echo
psql "$BATCHLEASE_PG_URL" -c 'SELECT task_id, last_fencing_token AS token, payload->>'"'"'worker'"'"' AS worker FROM task_state ORDER BY task_id'
psql "$BATCHLEASE_PG_URL" -c 'SELECT key AS account, version, state FROM versioned_state ORDER BY key'   # examples/speculative.yaml
# Both workers took part: each one's commits, and whether it is still running
# (they started together on an empty database; a migration race used to make
# one of them exit at once).
psql "$BATCHLEASE_PG_URL" -c "SELECT coalesce(payload->>'worker', '(unnamed)') AS worker, count(*) AS committed
  FROM task_state WHERE committed_token IS NOT NULL GROUP BY 1 ORDER BY 1"
for w in 1 2; do
  if kill -0 "${pids[$w]}" 2>/dev/null; then
    log "demo-worker-$w: running"
  else
    log "demo-worker-$w: EXITED — last lines of its log:"
    tail -n 5 "$run_dir/worker-$w.log" >&2
  fi
done
log "In another shell:"
log "  export KUBECONFIG=$KUBECONFIG PATH=$(dirname "$BATCHLEASE_KUBECTL"):\$PATH"
log "  kubectl get bt,tl -n demo      (logs: $run_dir/*.log)"
[ "${DEMO_EXIT:-0}" = 1 ] && exit 0
log "Ctrl-C stops it."
while kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
