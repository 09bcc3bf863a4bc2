"""Type stubs of the batchlease package (the Python worker SDK)."""

from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

JsonObject = Dict[str, Any]
SyncHandler = Callable[["Context"], Optional[JsonObject]]
AsyncHandler = Callable[["Context"], Awaitable[Optional[JsonObject]]]

class Worker:
    """Claims TaskLeases of its queues and runs a handler for each.

    ``queue`` is one name, a comma-separated list (``"fast,slow"``, as in
    ``BATCHLEASE_QUEUES``) or a sequence of names.

    ``identity`` defaults to ``<POD_NAME or host name>/<random suffix>``.
    With ``database_url`` (a PostgreSQL connection string, libpq URL or
    key=value) the worker migrates the fence's tables and SQL functions,
    registers each attempt's fencing token before its handler runs and
    keeps the attempt's deadline in the database extended while its lease
    is renewed, so ``ctx.fence_sql()`` fences the handler's own
    transactions. The Kubernetes configuration is KUBECONFIG, else
    in-cluster.
    """

    def __init__(
        self,
        namespace: str,
        queue: Union[str, Sequence[str]] = "default",
        slots: int = 1,
        identity: Optional[str] = None,
        database_url: Optional[str] = None,
        drain_grace_seconds: float = 20.0,
    ) -> None: ...
    def run(
        self, handler: Union[SyncHandler, AsyncHandler], isolation: str = "process"
    ) -> None:
        """Runs ``handler`` for every claimed task until SIGTERM or SIGINT,
        then drains: no new claims, running handlers get
        ``drain_grace_seconds``, the rest are given back as Interrupted.
        Blocks with the GIL released.

        ``handler(ctx)`` returns a dict (the task's ``status.result``,
        at most 128 KiB as JSON) or None; ``async def`` handlers are run on
        an asyncio loop of their own per attempt.

        Failures: ``RetryableError(reason, message)`` and
        ``PermanentError(reason, message)`` as given; a ``BatchleaseError``
        as the SDK maps it; any other exception is retryable with reason =
        the exception's class name (``ValueError``) and message = ``str(e)``.

        Kill switch (the lease can no longer be proven ours): an async
        handler is cancelled (``asyncio.CancelledError`` at its next
        ``await``). A sync handler with ``isolation="process"`` (default)
        runs in a child process (one per busy slot, from a forkserver,
        reused across attempts), which is SIGKILLed; it must then be
        picklable (a module-level function, the script's entry under
        ``if __name__ == "__main__":``), its result and exceptions are
        pickled back, and its ``ctx`` relays calls to the worker. With
        ``isolation="thread"`` it runs on a thread of the worker, which
        CANNOT be stopped: poll ``ctx.is_cancelled()``; its result is then
        discarded and its fenced writes are refused (``batchlease_fence``).
        """

class Context:
    """The context of one attempt."""

    @property
    def payload(self) -> JsonObject:
        """``spec.payload`` (``{}`` when the task has none)."""
    @property
    def token(self) -> int:
        """The attempt's fencing token (monotonic per task)."""
    @property
    def task_uid(self) -> str:
        """The BatchTask's UID: the key of its row in fenced storage."""
    @property
    def name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def attempt(self) -> int:
        """1 for the first attempt, 2 for the first retry, ..."""
    @property
    def previous_checkpoint(self) -> Optional[JsonObject]:
        """The last checkpoint of the previous attempt, to resume from."""
    @property
    def earlier_commit(self) -> Optional[JsonObject]:
        """``{"token": int, "payload": dict | None}`` when an earlier
        attempt's ``batchlease_commit`` stuck (with a database only)."""
    def checkpoint(self, progress: JsonObject) -> None:
        """Records progress; it travels with the next renewal and is handed
        to the next attempt as ``previous_checkpoint``. Raises
        ``InvalidData`` (too large, too deep) or ``TypeError`` (not a dict,
        not JSON)."""
    def is_cancelled(self) -> bool:
        """True once the kill switch fired: stop."""
    def check(self) -> None:
        """Raises ``Revoked`` if the attempt may no longer write."""
    def time_left(self) -> float:
        """Seconds before the kill switch fires unless a renewal succeeds."""
    def spawn(self, version: str, children: List[JsonObject]) -> List[str]:
        """Creates children of this task (the Rust SDK's ``ctx.spawn``):
        each ``{"spec": {<BatchTask spec: queue, payload, ...>}, "after":
        [indexes of earlier siblings it depends on]}``. Idempotent per
        ``version`` (a retry finds the same children; a different spec
        under a taken name raises ``BatchleaseError`` kind
        ``spawn_conflict``); checks the fence before each create. Returns
        the children's names. Blocks until created (in an async handler it
        blocks the loop for that time)."""
    def dependency_results(self) -> Dict[str, Optional[JsonObject]]:
        """The results of the task's ``dependsOn`` tasks, by name (blocks
        while they are read)."""
    def fence_sql(self) -> Tuple[str, Tuple[str, int]]:
        """``("SELECT batchlease_fence(%s, %s)", (task_uid, token))``: run it
        first in your own transaction (psycopg) to fence it::

            with conn.transaction():
                conn.execute(*ctx.fence_sql())
                conn.execute("UPDATE ...")

        It raises SQLSTATE LF001 (a newer attempt registered), LF002
        (deadline passed) or LF003 (not registered), and COMMIT is refused
        past the deadline. Needs ``Worker(database_url=...)``.
        """

class TaskFailure(Exception):
    reason: str
    message: str
    permanent: bool
    def __init__(self, reason: str, message: str = "") -> None: ...

class RetryableError(TaskFailure):
    """A retry may succeed."""

class PermanentError(TaskFailure):
    """A retry cannot help: dead-letter the task."""

class BatchleaseError(Exception):
    """An SDK error. ``kind``: the SDK's label; ``reason``/``permanent``:
    how the attempt fails if the handler lets it propagate."""

    message: str
    kind: str
    reason: str
    permanent: bool
    def __init__(
        self,
        message: str = "",
        kind: str = "sdk",
        reason: Optional[str] = None,
        permanent: bool = False,
    ) -> None: ...

class Revoked(BatchleaseError): ...
class Fenced(BatchleaseError): ...
class InvalidData(BatchleaseError): ...
class ConfigError(BatchleaseError): ...
