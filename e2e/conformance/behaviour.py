"""The conformance suite's behaviour (e2e/src/conformance.rs) as a worker of
the Python package, the counterpart of the demo worker's handler and of
behaviour.sh:

    {"steps": n, "stepMillis": ms, "failAfterSteps": k, "permanentFailure": b}

n steps from the previous checkpoint's {"step": i}, a checkpoint after each;
started from scratch with k > 0, a retryable failure after step k; with b, a
permanent failure after the steps; else one row of conformance_effects
written in a transaction fenced by batchlease_fence, and the result
{"resumedFrom": i, "token": t}; with "spawn": {"children": n, "version": v},
n one-step children first, named in the result as "children".

    python behaviour.py --namespace NS --queue Q --identity ID [--slots N]

PostgreSQL: BATCHLEASE_PG_URL (the worker registers each attempt there) and
CONFORMANCE_DB (the handler's own connection). A sync handler: it runs in a
child process, which the kill switch kills.
"""

from __future__ import annotations

import argparse
import os
import time

import batchlease
import psycopg


def handle(ctx: batchlease.Context) -> dict:
    p = ctx.payload
    steps = int(p.get("steps", 5))
    step_seconds = int(p.get("stepMillis", 200)) / 1000
    fail_after = int(p.get("failAfterSteps", 0))
    start = int((ctx.previous_checkpoint or {}).get("step", 0))
    children = None
    if "spawn" in p:
        # {"children": n, "version": v}: n children of one step each on
        # this queue, created before the parent can succeed.
        knob = p["spawn"]
        child = {"spec": {"queue": ctx.queue, "payload": {"steps": 1, "stepMillis": 50}}}
        children = ctx.spawn(str(knob.get("version", "v1")), [child] * int(knob["children"]))
    for i in range(start, steps):
        time.sleep(step_seconds)  # the "work"
        ctx.checkpoint({"step": i + 1})
        if start == 0 and fail_after == i + 1:
            raise batchlease.RetryableError(
                "FailAfterSteps", f"failing after {i + 1} steps, as the payload asks"
            )
    if p.get("permanentFailure"):
        raise batchlease.PermanentError(
            "PermanentFailure", "the payload asks for a permanent failure"
        )
    with psycopg.connect(os.environ["CONFORMANCE_DB"], autocommit=True) as conn:
        with conn.transaction():
            conn.execute(*ctx.fence_sql())
            conn.execute(
                "INSERT INTO conformance_effects (task_id, token) VALUES (%s, %s)",
                (ctx.task_uid, ctx.token),
            )
    result = {"resumedFrom": start, "token": ctx.token}
    if children is not None:
        result["children"] = children
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--queue", required=True)
    ap.add_argument("--identity", required=True)
    ap.add_argument("--slots", type=int, default=1)
    args = ap.parse_args()
    batchlease.Worker(
        args.namespace,
        queue=args.queue,
        slots=args.slots,
        identity=args.identity,
        database_url=os.environ["BATCHLEASE_PG_URL"],
        drain_grace_seconds=2.0,
    ).run(handle)


if __name__ == "__main__":
    main()
