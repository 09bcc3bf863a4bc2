"""Sync handlers in child processes, so the kill switch can stop them.

A Python thread cannot be stopped from outside. A sync handler therefore
runs in a child process (one per busy slot, reused across attempts, started
by a ``forkserver`` so the worker's Rust threads are never forked): the
worker's handler thread waits for it, relays the context's calls
(``checkpoint``, ``is_cancelled``, ...) and, the moment the kill switch
fires, SIGKILLs the child's process group and fails the attempt as
``Cancelled``. The next attempt gets a fresh child.

Each child leads a process group of its own, so whatever the handler
starts (``subprocess``: psql, ``aws s3 cp``, ffmpeg) is in it and dies with
it. Nothing of an attempt may outlive the attempt: after a handler returns
or raises, any other live member of the group is a leftover, and the whole
group is SIGKILLed before the result reaches the SDK (the child with it;
the next attempt starts a new one). A child whose attempt left nothing
behind is reused. A process that leaves the group on purpose
(``os.setsid``, ``start_new_session=True``) is outside this, as it is for
``batchlease-run``. Without ``/proc`` (not Linux) leftovers cannot be
listed, so every attempt's group is killed and no child is reused.

The handler is sent to the child by reference (pickle), so it must be a
module-level function of an importable module or of the main script, with
the script's entry under ``if __name__ == "__main__":``
(``multiprocessing``'s rule). Its return value and exceptions are pickled
back; an exception that cannot be pickled arrives as a ``RetryableError``
named for its class.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import traceback
from typing import Any, Callable, List, Optional

#: How often the waiting thread checks the kill switch (seconds).
POLL = 0.05

#: How long a new child may take to start (import the handler's module).
READY_TIMEOUT = 60.0


class _ChildContext:
    """The context as the child sees it: values copied, calls relayed."""

    def __init__(self, values: dict, conn: Any) -> None:
        self.__dict__.update(values)
        self._conn = conn

    def _call(self, name: str, *args: Any) -> Any:
        self._conn.send(("call", name, args))
        kind, value = self._conn.recv()
        if kind == "raise":
            raise value
        return value

    def checkpoint(self, progress: dict) -> None:
        self._call("checkpoint", progress)

    def is_cancelled(self) -> bool:
        return self._call("is_cancelled")

    def check(self) -> None:
        self._call("check")

    def time_left(self) -> float:
        return self._call("time_left")

    def spawn(self, version: str, children: list) -> list:
        return self._call("spawn", version, children)

    def dependency_results(self) -> dict:
        return self._call("dependency_results")

    def fence_sql(self):
        return ("SELECT batchlease_fence(%s, %s)", (self.task_uid, self.token))

    def __repr__(self) -> str:
        return f"Context(name={self.name!r}, namespace={self.namespace!r}, token={self.token}, attempt={self.attempt}, process=child)"


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RetryableError named for it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        from . import RetryableError

        return RetryableError(type(exc).__name__, str(exc))


def _child_main(conn: Any) -> None:
    """The child's loop: one attempt per message until the pipe closes.

    First it leads a process group of its own (``setpgid(0, 0)``: its pid
    is the group's id) and says so, so that the parent never signals a
    group that does not exist yet."""
    os.setpgid(0, 0)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        handler, values = msg
        ctx = _ChildContext(values, conn)
        try:
            result = handler(ctx)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            traceback.print_exc()
            conn.send(("err", _portable(e)))


def _group_members(pgid: int) -> Optional[List[int]]:
    """The live processes of group `pgid` (zombies excluded), or None
    where ``/proc`` cannot tell (not Linux)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces
                # and parentheses, so split after its last ")".
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


class _Child:
    def __init__(self, mp: Any) -> None:
        self.conn, child_end = mp.Pipe()
        self.process = mp.Process(target=_child_main, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()
        # The child leads its group once it says "ready" (EOFError if it
        # died first, or did not start in time: the caller reports the
        # process as dead).
        if not self.conn.poll(READY_TIMEOUT):
            self.process.kill()
            self.process.join(timeout=5)
            raise EOFError(f"the handler's process did not start within {READY_TIMEOUT} s")
        kind, pid = self.conn.recv()
        if kind != "ready" or pid != self.process.pid:
            raise EOFError(f"the handler's process began with {kind!r} {pid!r}, not ready")

    def left_something(self) -> bool:
        """True if a process other than the child itself lives in its
        group (or if that cannot be known)."""
        members = _group_members(self.process.pid)
        return members is None or any(m != self.process.pid for m in members)

    def kill(self) -> None:
        """SIGKILL to the child's whole group: the handler and whatever
        it started."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is gone already
        self.process.join(timeout=5)
        self.conn.close()


class ProcessHandler:
    """A sync handler run in child processes (see the module docs)."""

    def __init__(self, handler: Callable[[Any], Any]) -> None:
        try:
            pickle.dumps(handler)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"a sync handler runs in a child process and must be picklable "
                f"(a module-level function): {e}; or use Worker.run(handler, isolation='thread')"
            ) from e
        self._handler = handler
        self._mp = multiprocessing.get_context("forkserver")
        self._idle: List[_Child] = []
        self._lock = threading.Lock()

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.process.is_alive():
                    return child
                child.kill()
        return _Child(self._mp)

    def _give_back(self, child: _Child) -> None:
        """After an attempt that returned or raised: reused if it left no
        process behind, else its group is killed (leftovers included)."""
        if child.left_something():
            child.kill()
            return
        with self._lock:
            self._idle.append(child)

    def close(self) -> None:
        with self._lock:
            for child in self._idle:
                child.kill()
            self._idle.clear()

    def __call__(self, ctx: Any) -> Optional[dict]:
        from . import RetryableError

        values = {
            k: getattr(ctx, k)
            for k in (
                "payload", "token", "task_uid", "name", "namespace", "queue",
                "attempt", "previous_checkpoint", "earlier_commit",
            )
        }
        child = None
        try:
            child = self._take()
            child.conn.send((self._handler, values))
            while True:
                if ctx.is_cancelled():
                    child.kill()
                    raise RetryableError(
                        "Cancelled", "the kill switch fired: the handler's process was killed"
                    )
                if not child.conn.poll(POLL):
                    continue
                msg = child.conn.recv()
                if msg[0] == "call":
                    _, name, args = msg
                    try:
                        child.conn.send(("ret", getattr(ctx, name)(*args)))
                    except Exception as e:  # noqa: BLE001 - relayed to the child
                        child.conn.send(("raise", _portable(e)))
                    continue
                kind, value = msg
                self._give_back(child)
                if kind == "ok":
                    return value
                raise value
        except (EOFError, OSError, BrokenPipeError) as e:
            code = None
            if child is not None:
                child.kill()
                code = child.process.exitcode
            raise RetryableError(
                "HandlerProcessDied", f"the handler's process ended: {e!r} (exit code {code})"
            ) from None
