# Shared helpers for the e2e shell harness. Sourced, not run.

log() { echo "[$(date +%H:%M:%S)] ${LOG_TAG:-e2e} $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# openssl with the wall clock a day back (certificates valid from
# yesterday, so a process whose clock runs a little behind trusts them),
# through libfaketime directly. Not the `faketime` wrapper: it keeps a
# semaphore per pid in /dev/shm, and one left behind by a wrapper that was
# killed makes a later wrapper given the same pid fail ("sem_open: File
# exists") — which, with the output hidden, failed CI's TLS PostgreSQL
# start without a word. openssl's own output is shown when it fails.
gen() {
  local lib out
  lib=$(ls /usr/lib/*/faketime/libfaketime.so.1 2>/dev/null | head -1)
  [ -n "$lib" ] || die "libfaketime not found (Debian package faketime; hack/deps.sh installs it)"
  out=$(LD_PRELOAD=$lib FAKETIME=-1d FAKETIME_DONT_FAKE_MONOTONIC=1 openssl "$@" 2>&1) \
    || { echo "$out" >&2; die "openssl $1 failed"; }
}

# free_port: a TCP port on 127.0.0.1 nobody listens on right now.
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# wait_until DESCRIPTION TIMEOUT_SECONDS LOGFILE CMD...: polls CMD until it
# succeeds. On timeout prints the tail of LOGFILE (the component's log) and
# fails. The poll interval is short; the deadline is what matters.
wait_until() {
  local what=$1 timeout=$2 logfile=$3; shift 3
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "timed out after ${timeout}s waiting for $what; last lines of $logfile:"
      tail -n 40 "$logfile" >&2 || true
      return 1
    fi
    sleep 0.2
  done
  log "$what ready after $((timeout - (deadline - SECONDS)))s"
}

# stop_pidfile FILE: TERM the process, wait up to 10 s, then KILL.
stop_pidfile() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}
