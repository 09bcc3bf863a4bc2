#!/usr/bin/env bash
# Runs every check and test of batchlease. This is the README's test command
# and what CI (.ci/run) calls:
#   deps → fmt → clippy → unit tests → CRD drift → alerting rules (promtool)
#   → control plane, PostgreSQL
#   and a node (kubelet, containerd) → e2e tests (with the Python package
#   built) → the Python package's pytest → oldest Kubernetes → benchmark
#   smoke run → stop everything (always, via trap).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=test
. e2e/lib/common.sh
. hack/env.sh
. hack/local-env.sh

step() { log "== $*"; }

# cargo test, with its output also kept so the totals can be summed at the end.
results=$(mktemp)
cargo_test() {
  cargo test "$@" 2>&1 | tee -a "$results"
}
summary() {
  # cargo's "test result: ok. N passed; M failed; …" and pytest's last
  # line "N passed, M failed in 12.3s".
  awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
       /^(=+ )?[0-9]+ (passed|failed)/ && / in [0-9.]+s/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed,?$/) p += $i; if ($(i+1) ~ /^failed,?$/) f += $i } }
       END { printf "%d passed, %d failed\n", p, f }' "$results"
}

step "dependencies"
hack/deps.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "unit tests"
cargo_test --workspace --exclude batchlease-e2e --exclude batchlease-model --locked

# The bounded model check (docs/model.md); --nocapture prints the states
# each bound explored. A release build: the bounds (57 since bound
# attempts) took 706–817 s on 2 cores on 2026-12-03, several times that in a
# debug build; each bound stops at model/tests/check.rs's TIMEOUT.
step "model check"
cargo_test --locked --release -p batchlease-model -- --nocapture

step "CRD drift check"
cargo run -q --locked -p batchlease-operator --bin crdgen -- --check

# The chart's alerting rules: valid, and each alert fires where it must and
# only there (e2e/promtool/alerts_test.yaml). No cluster needed.
step "alerting rules (promtool check rules, promtool test rules)"
promtool=$(e2e/promtool/build.sh)/promtool
"$promtool" check rules charts/batchlease-operator/files/alerts.yaml
(cd e2e/promtool && "$promtool" test rules alerts_test.yaml)

step "start control plane, PostgreSQL and a node"
run_dir=$(mktemp -d /tmp/batchlease-test.XXXXXX)
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local_env_down "$run_dir"
  [ -d "$run_dir/cp-oldest" ] && e2e/controlplane/down.sh "$run_dir/cp-oldest" >/dev/null 2>&1
  [ "$rc" = 0 ] && rm -rf "$run_dir" || log "logs kept in $run_dir"
  summary # the last line: "N passed, N failed"
  rm -f "$results"
  exit "$rc"
}
trap cleanup EXIT INT TERM
local_env_up "$run_dir" node

step "e2e tests"
cargo build --locked -p batchlease-operator -p batchlease-demo-worker -p kubectl-batchlease -p batchlease-run
export BATCHLEASE_OPERATOR_BIN=$CARGO_TARGET_DIR/debug/batchlease-operator
export BATCHLEASE_DEMO_WORKER_BIN=$CARGO_TARGET_DIR/debug/batchlease-demo-worker
export BATCHLEASE_PLUGIN_BIN=$CARGO_TARGET_DIR/debug/kubectl-batchlease
export BATCHLEASE_RUN_BIN=$CARGO_TARGET_DIR/debug/batchlease-run
# The images, as hack/image.sh builds them (debug binaries: CI spares a
# release build; the release images differ only in the binary), and the
# OCI tools that check and run them (e2e/tests/image.rs).
oci_bin=$(e2e/oci/build.sh)
export BATCHLEASE_RUNC=$oci_bin/runc BATCHLEASE_CRANE=$oci_bin/crane
hack/image.sh --profile debug --out "$run_dir/images" >/dev/null
export BATCHLEASE_IMAGE_DIR=$run_dir/images
# …and on the node, where e2e/tests/node.rs and node_workers.rs run them as pods.
e2e/node/import.sh "$run_dir/node" "$run_dir"/images/*.oci.tar
# The Python package (maturin, into a cached venv): the conformance suite
# runs its workers with that interpreter. (hack/image.sh built the same
# wheel for the Python worker's image: this build is a no-op.)
BATCHLEASE_PYTHON_BIN=$(python/test.sh --build-only)
export BATCHLEASE_PYTHON_BIN
# hack/deps.sh installed Chromium and chromedriver: a browser test that
# cannot find them fails here instead of skipping (e2e/src/browser.rs).
export BATCHLEASE_REQUIRE_BROWSER=1
# --no-fail-fast: every test binary runs, and the summary counts them all.
cargo_test --locked --no-fail-fast -p batchlease-e2e -- --test-threads=4

# The Python package's own tests (pytest) on the same environment.
step "python package (pytest)"
python/test.sh 2>&1 | tee -a "$results"

# The oldest Kubernetes minor supported (e2e/controlplane/versions.env):
# a control plane of its own, where the CRDs install, their schema and CEL
# rules refuse what they must, the admission policy holds, and a task runs
# end to end with the operator and a worker.
oldest=$(BATCHLEASE_KUBE=oldest bash -c '. e2e/controlplane/versions.env; echo $KUBE_VERSION')
step "oldest supported Kubernetes ($oldest)"
BATCHLEASE_KUBE=oldest e2e/controlplane/up.sh "$run_dir/cp-oldest" >/dev/null
(
  . "$run_dir/cp-oldest/env"
  export BATCHLEASE_EXPECT_KUBE=$oldest
  cargo_test --locked --no-fail-fast -p batchlease-e2e --test crds --test validation --test admission --test oldest -- --test-threads=2
)
e2e/controlplane/down.sh "$run_dir/cp-oldest" >/dev/null

# Every benchmark phase at smoke size on the same control plane (what
# `hack/bench.sh --quick` runs on a fresh one): the phases keep working, and
# each bench namespace's recorded history is checked like a test's.
step "benchmark smoke run (bench --quick)"
cargo build --locked -p batchlease-e2e --bin bench
"$CARGO_TARGET_DIR/debug/bench" --quick
