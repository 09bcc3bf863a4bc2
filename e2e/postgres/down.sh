#!/usr/bin/env bash
# Stops the PostgreSQL cluster up.sh started in STATE_DIR and deletes it.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=postgres
. "$here/../lib/common.sh"
state=${1:?usage: down.sh STATE_DIR}
if [ -f "$state/pgbin" ] && [ -d "$state/data" ]; then
  pgbin=$(cat "$state/pgbin")
  as_user=()
  [ "$(id -u)" = 0 ] && as_user=(runuser -u "$(stat -c %U "$state/data")" --)
  "${as_user[@]}" "$pgbin/pg_ctl" -D "$state/data" -m immediate -w stop >/dev/null 2>&1 || true
fi
rm -rf "$state/data"
log "down: $state"
