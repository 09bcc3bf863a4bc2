#!/usr/bin/env bash
# The full fault soak (not part of CI; CI runs the quick mode as
# e2e/tests/soak.rs): a fresh local control plane and PostgreSQL, release
# builds, then the soak binary. Flags go to it:
#   hack/soak.sh --faults=1000 --tasks=1000 --seed=N --workers=3 --slots=2
#     [--renew-per-worker] [--drain-seconds=300]
# It prints the seed first and the report at the end (faults by kind, tasks,
# stale writes refused, violations); exit 1 on any violation.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=soak
. e2e/lib/common.sh
. hack/env.sh
. hack/local-env.sh
hack/deps.sh
cargo build -q --release -p batchlease-operator -p batchlease-demo-worker
cargo build -q --release -p batchlease-e2e --bin soak
export BATCHLEASE_OPERATOR_BIN=$CARGO_TARGET_DIR/release/batchlease-operator
export BATCHLEASE_DEMO_WORKER_BIN=$CARGO_TARGET_DIR/release/batchlease-demo-worker
run_dir=$(mktemp -d /tmp/batchlease-soak.XXXXXX)
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local_env_down "$run_dir"
  [ "$rc" = 0 ] && rm -rf "$run_dir" || log "logs kept in $run_dir"
  exit "$rc"
}
trap cleanup EXIT INT TERM
local_env_up "$run_dir"
"$CARGO_TARGET_DIR/release/soak" "$@"
