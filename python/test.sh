#!/usr/bin/env bash
# Builds the Python package (maturin, the abi3 wheel) into a venv outside
# the repository and runs its pytest suite against the real control plane,
# operator and PostgreSQL.
#
# Environment (what hack/test.sh has after local_env_up and its build):
#   KUBECONFIG, BATCHLEASE_PG_URL   the environment (hack/local-env.sh); if
#                                   either is unset, a local control plane
#                                   and PostgreSQL are started (no node)
#                                   and stopped on exit
#   BATCHLEASE_OPERATOR_BIN         the operator binary; built if unset
#   CARGO_TARGET_DIR, BATCHLEASE_CACHE   from hack/env.sh (sourced here)
#   BATCHLEASE_PYTHON               the interpreter (default python3, >= 3.9)
#   BATCHLEASE_PY_RELEASE=1         build the extension in release mode
# Extra arguments go to pytest (e.g. -k spin).
#
#   python/test.sh --build-only   builds and installs the package into the
#                                 venv and prints its interpreter (what the
#                                 e2e conformance suite runs as
#                                 BATCHLEASE_PYTHON_BIN); runs no test
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. hack/env.sh
. hack/local-env.sh

build_only=false
if [ "${1:-}" = --build-only ]; then
  build_only=true
  shift
fi

py=${BATCHLEASE_PYTHON:-python3}
# Pinned: the venv is cached, keyed by the interpreter and these versions.
reqs="maturin==1.16.0 pytest==9.2.0 psycopg[binary]==3.3.9"
pyv=$("$py" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$(printf '%s %s' "$pyv" "$reqs" | sha256sum | cut -c1-12)
venv=$BATCHLEASE_CACHE/python-venv-$pyv-$key
if [ ! -x "$venv/bin/pytest" ]; then
  echo "python/test.sh: creating $venv" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv" >&2
  # shellcheck disable=SC2086
  PIP_CACHE_DIR=$BATCHLEASE_CACHE/pip "$venv/bin/pip" install -q $reqs >&2
fi

# The wheel, built into the target directory (nothing is written into the
# repository), then installed into the venv.
wheels=$CARGO_TARGET_DIR/python-wheels
rm -rf "$wheels"
release=()
[ "${BATCHLEASE_PY_RELEASE:-}" = 1 ] && release=(--release)
PYO3_PYTHON=$venv/bin/python "$venv/bin/maturin" build --locked "${release[@]}" \
  --manifest-path python/Cargo.toml --interpreter "$venv/bin/python" -o "$wheels" >&2
"$venv/bin/pip" install -q --force-reinstall --no-deps "$wheels"/batchlease-*.whl >&2

if [ "$build_only" = true ]; then
  echo "$venv/bin/python"
  exit 0
fi

if [ -z "${KUBECONFIG:-}" ] || [ -z "${BATCHLEASE_PG_URL:-}" ]; then
  run_dir=$(mktemp -d /tmp/batchlease-py.XXXXXX)
  cleanup() {
    local rc=$?
    local_env_down "$run_dir" >/dev/null 2>&1 || true
    [ "$rc" = 0 ] && rm -rf "$run_dir" || echo "python/test.sh: logs kept in $run_dir" >&2
    exit "$rc"
  }
  trap cleanup EXIT INT TERM
  local_env_up "$run_dir"
fi
if [ -z "${BATCHLEASE_OPERATOR_BIN:-}" ]; then
  cargo build --locked -p batchlease-operator
  export BATCHLEASE_OPERATOR_BIN=$CARGO_TARGET_DIR/debug/batchlease-operator
fi

export BATCHLEASE_PY_TEST_LOGS=${BATCHLEASE_PY_TEST_LOGS:-$(mktemp -d /tmp/batchlease-py-logs.XXXXXX)}
echo "python/test.sh: process logs in $BATCHLEASE_PY_TEST_LOGS" >&2
cd python/tests
# Imports the installed package, not python/pysrc (not on the path here).
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
