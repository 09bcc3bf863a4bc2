# Shared helpers for the e2e shell harness. Sourced, not run.

log() { echo "[$(date +%H:%M:%S)] ${LOG_TAG:-e2e} $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

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
