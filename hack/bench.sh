#!/usr/bin/env bash
# Benchmarks on a fresh local control plane and PostgreSQL (issue 12).
#
#   hack/bench.sh            the full run: release builds, every phase at
#                            full size (≈ 45 min on 2 cores); plots go to
#                            e2e/bench/plots/ and a dated section (command,
#                            commit, versions, machine, results) is added at
#                            the top of e2e/bench/RESULTS.md's runs.
#   hack/bench.sh --quick    the smoke run (debug builds, every phase small,
#                            ≈ 4 min; hack/test.sh runs the same binary with
#                            --quick): prints the section, writes nothing.
#
# More flags go to the bench binary and override a phase's size (0 skips
# it), e.g. only the kill-switch phase:
#   hack/bench.sh --held=0 --window=0 --raw=0 --tasks=0 --scale=0 --dag=0 \
#     --locked=0 --speculative=0 --failover=0 --killswitch=20
# Phases and their flags (full / quick sizes):
#   --window=S --held=N   idle-operator requests over S-second windows, then
#                         N leases held at once (60 / 5 s; 1000 / 20)
#   --raw=N               raw writes of each kind (2000 / 100)
#   --tasks=N             no-op tasks end to end, workers renewing per lease
#                         and per worker side by side: writes/409s per task,
#                         ratio to the raw limit (2000 / 100)
#   --scale=N --probes=P  idle tasks up to N in five levels, P probes each
#                         (100000, 100 / 200, 10)
#   --dag=N --locked=N --speculative=N   workloads (1000, 200, 200 / 100, 20, 20)
#   --failover=N --killswitch=N          latency trials (20, 20 / 2, 2); the
#                         kill switch for each worker kind (Rust SDK, batchlease-run)
#   --kinds=N             no-op tasks end to end per worker kind, side by side
#                         (500 / 40)
#   --dashboard=N         the dashboard in headless Chromium with 100 and N
#                         tasks: time to first render, next page, memory
#                         (10000 / 200)
#   --fleet-workers=A,B,.. --fleet-leases=M --fleet-churn=N --fleet-ttl=S
#   --fleet-killswitch=K
#                         the fleet simulator (issue 27): for each worker
#                         count, that many hollow workers hold M leases;
#                         per held lease and per churn task, what the API
#                         server and etcd pay; failover and K kill-switch
#                         trials at that size (10,100,1000 / 1000 / 500 /
#                         30 s / 5; quick: 10 / 40 / 20 / 6 s / 1)
#   --concurrency=N       client concurrency of bulk writes (16)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
LOG_TAG=bench
. e2e/lib/common.sh
. hack/env.sh
. hack/local-env.sh

quick=false
args=()
for a in "$@"; do
  case $a in
    --quick) quick=true; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done

# What is built, taken before the build (a later edit is not in it).
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes: $(git diff --name-only HEAD | tr '\n' ' '))"

hack/deps.sh
if $quick; then
  profile=debug
  # Two builds: `--bin bench` would filter the other packages' binaries out.
  cargo build -q --locked -p batchlease-operator -p batchlease-demo-worker -p batchlease-run -p kubectl-batchlease
  cargo build -q --locked -p batchlease-e2e --bin bench
else
  profile=release
  cargo build -q --locked --release -p batchlease-operator -p batchlease-demo-worker -p batchlease-run -p kubectl-batchlease
  cargo build -q --locked --release -p batchlease-e2e --bin bench
  args+=("--out=$root/e2e/bench/plots")
fi
export BATCHLEASE_OPERATOR_BIN=$CARGO_TARGET_DIR/$profile/batchlease-operator
export BATCHLEASE_DEMO_WORKER_BIN=$CARGO_TARGET_DIR/$profile/batchlease-demo-worker
export BATCHLEASE_RUN_BIN=$CARGO_TARGET_DIR/$profile/batchlease-run
# The dashboard phase serves `kubectl batchlease dashboard`.
export BATCHLEASE_PLUGIN_BIN=$CARGO_TARGET_DIR/$profile/kubectl-batchlease
# The Python package, for the worker-kind phases (a release extension
# beside the release binaries of the full run).
if [ "$profile" = release ]; then
  BATCHLEASE_PYTHON_BIN=$(BATCHLEASE_PY_RELEASE=1 python/test.sh --build-only)
else
  BATCHLEASE_PYTHON_BIN=$(python/test.sh --build-only)
fi
export BATCHLEASE_PYTHON_BIN

run_dir=$(mktemp -d /tmp/batchlease-bench.XXXXXX)
cleanup() {
  trap - EXIT INT TERM
  local_env_down "$run_dir"
  rm -rf "$run_dir"
}
trap cleanup EXIT INT TERM
local_env_up "$run_dir"

out=$run_dir/bench.out
"$CARGO_TARGET_DIR/$profile/bench" "${args[@]}" | tee "$out"

# The dated section: what ran, on what, and what it printed.
section=$run_dir/section.md
pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
{
  echo "## Run of $(date -u '+%Y-%m-%d %H:%M UTC') ($($quick && echo quick || echo full))"
  echo
  echo '```sh'
  echo "hack/bench.sh $*"
  echo '```'
  echo
  echo "- commit: $commit; $profile builds"
  echo "- $(rustc --version); kube-apiserver $(kube-apiserver --version 2>/dev/null | awk '{print $2}'); etcd $(etcd --version 2>/dev/null | awk '/etcd Version/ {print $3}'); $("$pgbin/postgres" --version 2>/dev/null)"
  echo "- machine: $(nproc) cores ($(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), Linux $(uname -r); everything (control plane, PostgreSQL, operator, workers, load) on this machine"
  echo
  echo '```'
  sed -n '/^--- results ---$/,$p' "$out" | tail -n +2
  echo '```'
} > "$section"
cat "$section"
if ! $quick; then
  # Newest run first, below the marker line of RESULTS.md.
  python3 - "$root/e2e/bench/RESULTS.md" "$section" <<'PY'
import sys
path, section = sys.argv[1], open(sys.argv[2]).read()
text = open(path).read()
marker = "<!-- runs: newest first -->\n"
if marker not in text:
    sys.exit(f"{path}: no line '{marker.strip()}' to add the run below")
open(path, "w").write(text.replace(marker, marker + "\n" + section, 1))
PY
  log "added the run to e2e/bench/RESULTS.md; plots in e2e/bench/plots/"
fi
