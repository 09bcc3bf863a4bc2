# Sourced by hack/test.sh, demo.sh and bench.sh: a local control plane and a
# throwaway PostgreSQL under one run directory, and with `node` a node too.

# local_env_up DIR [node]: starts them under DIR and exports their
# environment (KUBECONFIG, BATCHLEASE_KUBECTL, BATCHLEASE_HELM,
# BATCHLEASE_PG_URL, …; with `node`, BATCHLEASE_NODE and the rest of
# e2e/node/up.sh's env: a kubelet and containerd that run pods, which
# hack/test.sh starts for e2e/tests/node.rs; the API server then also
# listens on this host's address, where pods on the node's pod network
# reach it).
# With BATCHLEASE_PG_TLS=1 the PostgreSQL accepts TLS only and
# BATCHLEASE_PG_URL carries sslmode=verify-full and its CA (meant for
# hack/demo.sh; the e2e suite reads its database without TLS, and
# e2e/tests/postgres_tls.rs starts a TLS one of its own).
local_env_up() {
  local dir=$1
  mkdir -p "$dir"
  chmod 755 "$dir" # PostgreSQL runs as an unprivileged user and must reach it
  if [ "${2:-}" = node ]; then
    BATCHLEASE_CP_BIND=host e2e/controlplane/up.sh "$dir/cp" >/dev/null
  else
    e2e/controlplane/up.sh "$dir/cp" >/dev/null
  fi
  e2e/postgres/up.sh "$dir/pg" >/dev/null
  . "$dir/cp/env"
  . "$dir/pg/env"
  if [ "${2:-}" = node ]; then
    e2e/node/up.sh "$dir/node" "$dir/cp" >/dev/null
    . "$dir/node/env"
  fi
}

# local_env_down DIR: stops them; safe to call twice or after a failed start.
local_env_down() {
  e2e/node/down.sh "$1/node" || true
  e2e/controlplane/down.sh "$1/cp" || true
  e2e/postgres/down.sh "$1/pg" || true
}
