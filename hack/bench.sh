#!/usr/bin/env bash
# Benchmarks (not part of CI): raw API-server write throughput vs. end-to-end
# task throughput side by side, and one operator with many tasks. Release
# builds, a fresh local control plane and PostgreSQL. Flags go to the bench:
#   hack/bench.sh --raw=2000 --tasks=500 --scale=10000 --concurrency=16 --dag=1000 --locked=200 --speculative=200 --failover=20
# (a phase with 0 is skipped). --speculative=N: N demo transfers (20 ms
# think) in each of Speculative and Exclusive mode, over 100 accounts (low
# contention) and with every transfer touching one hot account (high
# contention): tasks/s, p50/p95 latency from the create request to the
# task seen Succeeded, abort rates, quarantined tasks; the balances are
# checked. Only that phase:
#   hack/bench.sh --raw=0 --tasks=0 --scale=0 --dag=0 --locked=0 --speculative=200 --failover=0
# --failover=N: N trials of SIGSTOPping the worker that holds a task (TTL
# 5 s) and timing, from lease watch events, until the other worker holds
# it: p50/p95/max next to the TTL. The --tasks phase also reports API
# writes and 409s per task as the API server counted them.
# Results: e2e/bench/RESULTS.md (append the printed block by hand, with the
# command and the date).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=bench
. e2e/lib/common.sh
. hack/env.sh
. hack/local-env.sh
hack/deps.sh
cargo build -q --release -p batchlease-operator -p batchlease-demo-worker
cargo build -q --release -p batchlease-e2e --bin bench
export BATCHLEASE_OPERATOR_BIN=$CARGO_TARGET_DIR/release/batchlease-operator
export BATCHLEASE_DEMO_WORKER_BIN=$CARGO_TARGET_DIR/release/batchlease-demo-worker
run_dir=$(mktemp -d /tmp/batchlease-bench.XXXXXX)
cleanup() {
  trap - EXIT INT TERM
  local_env_down "$run_dir"
  rm -rf "$run_dir"
}
trap cleanup EXIT INT TERM
local_env_up "$run_dir"
"$CARGO_TARGET_DIR/release/bench" "$@"
