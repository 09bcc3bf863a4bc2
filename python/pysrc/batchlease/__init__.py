"""batchlease: run batchlease tasks from Python.

A thin layer over the Rust worker SDK (``batchlease._native``): claims,
the lease heartbeat (on a Rust thread, outside the GIL), the kill switch
and the fenced PostgreSQL registration all run in Rust. See docs/python.md.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

__all__ = [
    "Worker",
    "Context",
    "TaskFailure",
    "RetryableError",
    "PermanentError",
    "BatchleaseError",
    "Revoked",
    "Fenced",
    "InvalidData",
    "ConfigError",
]


class TaskFailure(Exception):
    """Raised by a handler to fail its attempt with a reason of its own."""

    permanent = False

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(reason, message)
        self.reason = reason
        self.message = message

    def __str__(self) -> str:
        return f"{self.reason}: {self.message}"


class RetryableError(TaskFailure):
    """A retry may succeed: spends one of the task's retries."""


class PermanentError(TaskFailure):
    """A retry cannot help: the task is dead-lettered at once."""

    permanent = True


class BatchleaseError(Exception):
    """An error of the SDK, raised by the context or by ``Worker.run``.

    ``kind`` is the SDK's low-cardinality label (``revoked``, ``fenced``,
    ...). If a handler lets it propagate, the attempt fails as the Rust SDK
    would fail it: with ``reason``, permanently if ``permanent``.
    """

    def __init__(
        self,
        message: str = "",
        kind: str = "sdk",
        reason: Optional[str] = None,
        permanent: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.reason = reason or "SdkError"
        self.permanent = permanent


class Revoked(BatchleaseError):
    """The attempt's lease is no longer ours (the kill switch fired)."""


class Fenced(BatchleaseError):
    """Storage holds a newer fencing token: this attempt is a zombie."""


class InvalidData(BatchleaseError):
    """A checkpoint or result that is not a JSON object, or too large/deep."""


class ConfigError(BatchleaseError):
    """The worker is configured wrongly (or has no cluster configuration)."""


import inspect as _inspect  # noqa: E402

from . import _native  # noqa: E402
from ._native import Context  # noqa: E402


def _queues(value: Union[str, Sequence[str]]) -> list:
    """A queue name, a comma-separated list (as ``BATCHLEASE_QUEUES``, the
    variable every worker kind and the worker chart use) or a sequence of
    names, as a list."""
    names = value.split(",") if isinstance(value, str) else list(value)
    return [n.strip() for n in names if n.strip()]


class Worker:
    """Claims TaskLeases of its queues and runs a handler for each (see the
    stubs, ``__init__.pyi``, and docs/python.md)."""

    def __init__(
        self,
        namespace: str,
        queue: Union[str, Sequence[str]] = "default",
        slots: int = 1,
        identity: Optional[str] = None,
        database_url: Optional[str] = None,
        drain_grace_seconds: float = 20.0,
    ) -> None:
        self._native = _native.Worker(
            namespace,
            queues=_queues(queue),
            slots=slots,
            identity=identity,
            database_url=database_url,
            drain_grace_seconds=drain_grace_seconds,
        )

    def run(self, handler, isolation: str = "process") -> None:
        """Runs ``handler`` until SIGTERM/SIGINT, then drains.

        ``isolation`` applies to sync handlers: ``"process"`` (default) runs
        each attempt in a child process that the kill switch kills;
        ``"thread"`` runs it on a thread of this process, which the kill
        switch cannot stop (poll ``ctx.is_cancelled()``). Async handlers
        always run on an asyncio loop of their own and are cancelled.
        """
        if isolation not in ("process", "thread"):
            raise ValueError("isolation must be 'process' or 'thread'")
        if _inspect.iscoroutinefunction(handler) or isolation == "thread":
            self._native.run(handler)
            return
        from ._process import ProcessHandler

        wrapped = ProcessHandler(handler)
        try:
            self._native.run(wrapped)
        finally:
            wrapped.close()

    def __repr__(self) -> str:
        return repr(self._native)
