#!/usr/bin/env bash
# Starts a throwaway PostgreSQL cluster (initdb in STATE_DIR, loopback only,
# a free port) from Debian's postgresql packages and writes STATE_DIR/env
# with BATCHLEASE_PG_URL. Stop with down.sh STATE_DIR.
#
#   up.sh [--tls] [STATE_DIR]        (or BATCHLEASE_PG_TLS=1)
#
# --tls: accepts TLS connections only, as managed PostgreSQL does — ssl=on
# with a server certificate (SAN IP:127.0.0.1, DNS:localhost) signed by a
# test CA made here with openssl, pg_hba.conf `hostssl … trust` and
# `hostnossl … reject`. STATE_DIR/env then also has BATCHLEASE_PG_CA (the
# CA file) and BATCHLEASE_PG_PLAIN_URL (the URL without TLS parameters),
# and BATCHLEASE_PG_URL carries sslmode=verify-full&sslrootcert=<the CA>.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_TAG=postgres
. "$here/../lib/common.sh"

tls=${BATCHLEASE_PG_TLS:-0}
if [ "${1:-}" = --tls ]; then tls=1; shift; fi
state=${1:-$(mktemp -d /tmp/batchlease-pg.XXXXXX)}
mkdir -p "$state"
state=$(cd "$state" && pwd)
pgbin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
[ -x "$pgbin/initdb" ] || die "PostgreSQL server binaries not found (install Debian's postgresql package)"

tls_opts=()
if [ "$tls" = 1 ]; then
  # Valid from a day ago for three days (as the control plane's): a process
  # whose clock runs a little behind still trusts it.
  command -v openssl >/dev/null || die "openssl is required for --tls (hack/deps.sh installs it)"
  command -v faketime >/dev/null || die "faketime is required for --tls (hack/deps.sh installs it)"
  pki=$state/tls
  mkdir -p "$pki"
  gen genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/ca.key"
  gen req -x509 -new -key "$pki/ca.key" -subj "/CN=batchlease-e2e-pg-ca" -days 3 -out "$pki/ca.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  gen genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/server.key"
  gen req -new -key "$pki/server.key" -subj "/CN=127.0.0.1" -out "$pki/server.csr"
  printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" "basicConstraints=CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" > "$pki/server.ext"
  gen x509 -req -in "$pki/server.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3 -extfile "$pki/server.ext" -out "$pki/server.crt"
  [ -s "$pki/server.crt" ] || die "openssl could not make the server certificate"
  chmod 600 "$pki/server.key" "$pki/ca.key"
  chmod 644 "$pki/ca.crt"
  tls_opts=(-c ssl=on -c "ssl_cert_file=$pki/server.crt" -c "ssl_key_file=$pki/server.key")
fi

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
if [ "$tls" = 1 ]; then
  # TLS or nothing over TCP (the Unix socket stays open for the tools).
  "${as_user[@]}" tee "$data/pg_hba.conf" >/dev/null <<'HBA'
local     all all              trust
hostssl   all all 127.0.0.1/32 trust
hostnossl all all 0.0.0.0/0    reject
hostssl   all all ::1/128      trust
hostnossl all all ::/0         reject
HBA
fi
"${as_user[@]}" "$pgbin/pg_ctl" -D "$data" -l "$state/postgres.log" -w -t 60 start \
  -o "-c listen_addresses=127.0.0.1 -p $port -k $state -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 ${tls_opts[*]}" \
  >/dev/null || { tail -n 20 "$state/postgres.log" >&2; die "postgres failed to start"; }
echo "$pgbin" > "$state/pgbin"
ready() { "$pgbin/pg_isready" -h 127.0.0.1 -p "$port" -U batchlease; }
wait_until postgres 60 "$state/postgres.log" ready
sslmode=disable
[ "$tls" = 1 ] && sslmode=require
"$pgbin/psql" "host=127.0.0.1 port=$port user=batchlease dbname=postgres sslmode=$sslmode" \
  -qc 'CREATE DATABASE batchlease' >/dev/null
url=postgres://batchlease@127.0.0.1:$port/batchlease
if [ "$tls" = 1 ]; then
  cat > "$state/env" <<ENV
export BATCHLEASE_PG_URL='$url?sslmode=verify-full&sslrootcert=$pki/ca.crt'
export BATCHLEASE_PG_PLAIN_URL=$url
export BATCHLEASE_PG_CA=$pki/ca.crt
ENV
  log "up (TLS only, CA $pki/ca.crt): $url?sslmode=verify-full&sslrootcert=$pki/ca.crt"
else
  cat > "$state/env" <<ENV
export BATCHLEASE_PG_URL=$url
ENV
  log "up: $url"
fi
echo "$state"
