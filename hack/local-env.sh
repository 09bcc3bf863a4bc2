# Sourced by hack/test.sh, demo.sh and bench.sh: a local control plane and a
# throwaway PostgreSQL under one run directory.

# local_env_up DIR: starts both under DIR and exports their environment
# (KUBECONFIG, BATCHLEASE_KUBECTL, BATCHLEASE_HELM, BATCHLEASE_PG_URL, …).
# With BATCHLEASE_PG_TLS=1 the PostgreSQL accepts TLS only and
# BATCHLEASE_PG_URL carries sslmode=verify-full and its CA (meant for
# hack/demo.sh; the e2e suite reads its database without TLS, and
# e2e/tests/postgres_tls.rs starts a TLS one of its own).
local_env_up() {
  local dir=$1
  mkdir -p "$dir"
  chmod 755 "$dir" # PostgreSQL runs as an unprivileged user and must reach it
  e2e/controlplane/up.sh "$dir/cp" >/dev/null
  e2e/postgres/up.sh "$dir/pg" >/dev/null
  . "$dir/cp/env"
  . "$dir/pg/env"
}

# local_env_down DIR: stops both; safe to call twice or after a failed start.
local_env_down() {
  e2e/controlplane/down.sh "$1/cp" || true
  e2e/postgres/down.sh "$1/pg" || true
}
