"""The worker the tests run (as a subprocess): behaviour chosen by the
task's payload ``{"action": ...}``; ``--mode async`` serves the same
actions from an ``async def`` handler."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import batchlease


def fenced_write(ctx: batchlease.Context) -> dict:
    """A write of our own fenced by ``batchlease_fence``, and one with a
    token that is not ours (refused with LF003)."""
    import psycopg

    url = os.environ["BATCHLEASE_PG_URL"]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS py_fenced_out (task text PRIMARY KEY, token bigint)"
        )
        with conn.transaction():
            conn.execute(*ctx.fence_sql())
            conn.execute(
                "INSERT INTO py_fenced_out VALUES (%s, %s) "
                "ON CONFLICT (task) DO UPDATE SET token = EXCLUDED.token",
                (ctx.task_uid, ctx.token),
            )
        refused = None
        try:
            with conn.transaction():
                conn.execute("SELECT batchlease_fence(%s, %s)", (ctx.task_uid, ctx.token + 1))
        except psycopg.Error as e:
            refused = e.sqlstate
    return {"written": ctx.token, "wrongTokenRefused": refused}


def spin(seconds: float) -> int:
    """Pure Python, never releasing the GIL voluntarily."""
    until = time.monotonic() + seconds
    n = 0
    while time.monotonic() < until:
        n += 1
    return n


def handle(ctx: batchlease.Context):
    p = ctx.payload
    action = p.get("action", "echo")
    if action == "echo":
        return {"echo": p, "attempt": ctx.attempt, "token": ctx.token, "name": ctx.name}
    if action == "pid":
        return {"pid": os.getpid()}
    if action == "retry_once":
        if ctx.attempt == 1:
            ctx.checkpoint({"step": 7})
            raise batchlease.RetryableError("FlakyThing", "try again")
        return {"attempt": ctx.attempt, "resumedFrom": ctx.previous_checkpoint}
    if action == "permanent":
        raise batchlease.PermanentError("BadInput", "this input can never work")
    if action == "crash":
        raise ValueError("not a number")
    if action == "spin":
        n = spin(float(p["seconds"]))
        return {"spins": n > 0, "attempt": ctx.attempt, "cancelled": ctx.is_cancelled()}
    if action == "nap":
        time.sleep(float(p["seconds"]))
        return {"napped": True, "cancelled": ctx.is_cancelled()}
    if action == "hang":
        # Never checks ctx: only killing its process stops it.
        with open(p["pidfile"], "w") as f:
            f.write(str(os.getpid()))
        spin(1e9)
    if action in ("subprocess_hang", "subprocess_return"):
        # Starts a process of its own (as a handler running psql or ffmpeg
        # would), records both pids, then hangs or returns with it running.
        import subprocess

        sub = subprocess.Popen(["sleep", "600"])
        with open(p["pidfile"], "w") as f:
            f.write(f"{os.getpid()} {sub.pid}")
        if action == "subprocess_hang":
            spin(1e9)
        return {"handler": os.getpid(), "subprocess": sub.pid}
    if action == "fenced_write":
        return fenced_write(ctx)
    if action == "spawn":
        child = {"queue": ctx.queue, "payload": {"action": "echo"}}
        names = ctx.spawn("v1", [{"spec": child}, {"spec": child, "after": [0]}])
        return {"children": names}
    if action == "read_deps":
        return {"deps": ctx.dependency_results()}
    raise batchlease.PermanentError("UnknownAction", action)


async def handle_async(ctx: batchlease.Context):
    await asyncio.sleep(0.01)
    p = ctx.payload
    if p.get("action") == "sleep":
        try:
            await asyncio.sleep(float(p["seconds"]))
        except asyncio.CancelledError:
            # The kill switch cancelled us: leave a mark for the test.
            with open(p["marker"], "w") as f:
                f.write(f"cancelled {ctx.token} {ctx.is_cancelled()}")
            raise
        return {"slept": True}
    out = handle(ctx)
    await asyncio.sleep(0.01)
    if isinstance(out, dict):
        out["async"] = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--queue", default="default")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--mode", choices=["sync", "async"], default="sync")
    ap.add_argument("--isolation", choices=["process", "thread"], default="process")
    a = ap.parse_args()
    worker = batchlease.Worker(
        a.namespace,
        queue=a.queue,
        slots=a.slots,
        database_url=os.environ.get("BATCHLEASE_PG_URL"),
        drain_grace_seconds=2,
    )
    if a.mode == "async":
        worker.run(handle_async)
    else:
        worker.run(handle, isolation=a.isolation)


if __name__ == "__main__":
    main()
