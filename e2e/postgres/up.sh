#!/usr/bin/env bash
# Starts a throwaway PostgreSQL cluster (initdb in STATE_DIR, loopback only,
# a free port) from Debian's postgresql packages and writes STATE_DIR/env
# with BATCHLEASE_PG_URL. Stop with down.sh STATE_DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=postgres
. "$here/../lib/common.sh"

state=${1:-$(mktemp -d /tmp/batchlease-pg.XXXXXX)}
mkdir -p "$state"
state=$(cd "$state" && pwd)
pgbin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
[ -x "$pgbin/initdb" ] || die "PostgreSQL server binaries not found (install Debian's postgresql package)"

# PostgreSQL refuses to run as root: run it as an unprivileged user.
as_user=()
if [ "$(id -u)" = 0 ]; then
  user=${PG_USER:-postgres}
  id "$user" >/dev/null 2>&1 || die "user '$user' missing (it comes with Debian's postgresql package)"
  chown -R "$user" "$state"
  chmod 755 "$state"
  as_user=(runuser -u "$user" --)
  "${as_user[@]}" test -w "$state" ||
    die "user '$user' cannot reach $state: every parent directory must be traversable (chmod o+x)"
fi
port=$(free_port)
data=$state/data
"${as_user[@]}" "$pgbin/initdb" -D "$data" -U batchlease --auth=trust -E UTF8 --no-sync >"$state/initdb.log" 2>&1 \
  || { tail -n 20 "$state/initdb.log" >&2; die "initdb failed"; }
"${as_user[@]}" "$pgbin/pg_ctl" -D "$data" -l "$state/postgres.log" -w -t 60 start \
  -o "-c listen_addresses=127.0.0.1 -p $port -k $state -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
  >/dev/null || { tail -n 20 "$state/postgres.log" >&2; die "postgres failed to start"; }
echo "$pgbin" > "$state/pgbin"
ready() { "$pgbin/pg_isready" -h 127.0.0.1 -p "$port" -U batchlease; }
wait_until postgres 60 "$state/postgres.log" ready
"$pgbin/psql" -h 127.0.0.1 -p "$port" -U batchlease -d postgres -qc 'CREATE DATABASE batchlease' >/dev/null
cat > "$state/env" <<ENV
export BATCHLEASE_PG_URL=postgres://batchlease@127.0.0.1:$port/batchlease
ENV
log "up: postgres://batchlease@127.0.0.1:$port/batchlease"
echo "$state"
