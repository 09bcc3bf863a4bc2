"""batchlease: run batchlease tasks from Python.

A thin layer over the Rust worker SDK (``batchlease._native``): claims,
the lease heartbeat (on a Rust thread, outside the GIL), the kill switch
and the fenced PostgreSQL registration all run in Rust. See docs/python.md.
"""

from __future__ import annotations

from typing import Optional

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


from ._native import Context, Worker  # noqa: E402
