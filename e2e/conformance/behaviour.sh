#!/bin/sh
# The conformance suite's behaviour (e2e/src/conformance.rs) as a shell
# task for batchlease-run, the counterpart of the demo worker's handler:
#   {"steps": n, "stepMillis": ms, "failAfterSteps": k, "permanentFailure": b}
# Works n steps from the previous checkpoint's {"step": i}, writing the
# checkpoint after each; started from scratch with k > 0, exits with the
# retry code (75) after step k; with b, exits with the permanent code (65)
# after the steps. Else it writes its effect — a row of
# conformance_effects, fenced by batchlease_fence in the same transaction —
# and the result {"resumedFrom": i, "token": t}.
set -eu
eval "$(python3 - "$BATCHLEASE_PAYLOAD_FILE" "$BATCHLEASE_CHECKPOINT_FILE" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
try:
    c = json.load(open(sys.argv[2]))
except ValueError:
    c = {}
print("steps=%d" % int(p.get("steps", 5)))
print("step_seconds=%.3f" % (int(p.get("stepMillis", 200)) / 1000))
print("fail_after=%d" % int(p.get("failAfterSteps", 0)))
print("permanent=%d" % (1 if p.get("permanentFailure") else 0))
print("from=%d" % int(c.get("step", 0)))
PY
)"
i=$from
while [ "$i" -lt "$steps" ]; do
  sleep "$step_seconds"
  i=$((i + 1))
  # Whole or not at all: the runner reads the file while we write it.
  printf '{"step": %d}' "$i" > "$BATCHLEASE_CHECKPOINT_FILE.new"
  mv "$BATCHLEASE_CHECKPOINT_FILE.new" "$BATCHLEASE_CHECKPOINT_FILE"
  if [ "$from" = 0 ] && [ "$fail_after" = "$i" ]; then
    echo "failing after $i steps, as the payload asks" >&2
    exit 75
  fi
done
if [ "$permanent" = 1 ]; then
  echo "the payload asks for a permanent failure" >&2
  exit 65
fi
psql "$CONFORMANCE_DB" -X -q -o /dev/null -v ON_ERROR_STOP=1 \
  -v uid="$BATCHLEASE_TASK_UID" -v token="$BATCHLEASE_FENCING_TOKEN" <<'SQL'
BEGIN;
SELECT batchlease_fence(:'uid', :token);
INSERT INTO conformance_effects (task_id, token) VALUES (:'uid', :token);
COMMIT;
SQL
printf '{"resumedFrom": %d, "token": %d}' "$from" "$BATCHLEASE_FENCING_TOKEN" > "$BATCHLEASE_RESULT_FILE"
