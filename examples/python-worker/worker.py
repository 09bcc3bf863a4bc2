"""A batchlease worker in Python: works through a task in steps with a
checkpoint after each (a retry resumes where the last attempt got), then
writes its result to PostgreSQL in a transaction fenced by the attempt's
token.

    python examples/python-worker/worker.py --namespace NS --queue Q --slots N

Payload: ``{"steps": 5, "stepMillis": 200}``. The PostgreSQL connection
string comes from BATCHLEASE_PG_URL_FILE (a mounted Secret) or
BATCHLEASE_PG_URL; without one the result goes only into the task's status.
The Kubernetes client configuration is KUBECONFIG, else in-cluster. See
docs/python.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Optional

import batchlease

log = logging.getLogger("python-worker")

RESULTS = """
CREATE TABLE IF NOT EXISTS python_worker_results (
  task_uid text PRIMARY KEY,
  token bigint NOT NULL,
  steps bigint NOT NULL,
  written_at timestamptz NOT NULL DEFAULT now()
)"""


def database_url() -> Optional[str]:
    path = os.environ.get("BATCHLEASE_PG_URL_FILE")
    if path:
        with open(path) as f:
            return f.read().strip()
    return os.environ.get("BATCHLEASE_PG_URL")


def handle(ctx: batchlease.Context) -> dict:
    """One attempt. Runs in a child process of the worker (the default for
    sync handlers), which the kill switch kills if the lease is lost."""
    steps = int(ctx.payload.get("steps", 5))
    step_seconds = int(ctx.payload.get("stepMillis", 200)) / 1000
    if steps < 0:
        raise batchlease.PermanentError("InvalidPayload", "steps must be >= 0")
    start = (ctx.previous_checkpoint or {}).get("step", 0)
    for step in range(start, steps):
        time.sleep(step_seconds)  # the "work"
        ctx.checkpoint({"step": step + 1})
    url = database_url()
    committed = False
    if url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(RESULTS)
            # Fenced: refused (SQLSTATE LF001/LF002/LF003) once a newer
            # attempt registered or this one's lease deadline passed; the
            # COMMIT is checked against the deadline again.
            with conn.transaction():
                conn.execute(*ctx.fence_sql())
                conn.execute(
                    "INSERT INTO python_worker_results (task_uid, token, steps) VALUES (%s, %s, %s) "
                    "ON CONFLICT (task_uid) DO UPDATE SET token = EXCLUDED.token, steps = EXCLUDED.steps, "
                    "written_at = now()",
                    (ctx.task_uid, ctx.token, steps),
                )
        committed = True
    log.info("task %s done (token %d, resumed from %d)", ctx.name, ctx.token, start)
    return {"steps": steps, "resumedFrom": start, "token": ctx.token, "committed": committed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--namespace", default=os.environ.get("BATCHLEASE_TASK_NAMESPACE", "default"),
                    help="namespace whose tasks to run")
    ap.add_argument("--queue", default=os.environ.get("BATCHLEASE_QUEUES", "demo"),
                    help="queues to serve, comma-separated (BATCHLEASE_QUEUES, as every worker kind)")
    ap.add_argument("--slots", type=int, default=int(os.environ.get("BATCHLEASE_SLOTS", "2")))
    ap.add_argument("--drain-grace-seconds", type=float,
                    default=float(os.environ.get("BATCHLEASE_DRAIN_GRACE_SECONDS", "20")))
    args = ap.parse_args()
    if os.environ.get("BATCHLEASE_QUEUE") and not os.environ.get("BATCHLEASE_QUEUES"):
        # The variable of an earlier version of this example: serving
        # "demo" instead would leave the intended queue's tasks unclaimed.
        ap.error("BATCHLEASE_QUEUE is not read: set BATCHLEASE_QUEUES "
                 "(comma-separated, as the worker chart does)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = batchlease.Worker(
        args.namespace,
        queue=args.queue,
        slots=args.slots,
        database_url=database_url(),
        drain_grace_seconds=args.drain_grace_seconds,
    )
    # Blocks until SIGTERM/SIGINT, then drains.
    worker.run(handle)


if __name__ == "__main__":
    main()
