"""Fixtures: the real control plane and PostgreSQL (hack/local-env.sh's
``local_env_up``: KUBECONFIG, BATCHLEASE_PG_URL), the real operator
(BATCHLEASE_OPERATOR_BIN) per test namespace, and the test worker
(worker_main.py) as a subprocess."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Optional

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
LOGS = Path(os.environ.get("BATCHLEASE_PY_TEST_LOGS", tempfile.mkdtemp(prefix="batchlease-py-")))


def _need(var: str) -> str:
    v = os.environ.get(var)
    if not v:
        pytest.fail(f"{var} is unset: start the environment (hack/local-env.sh local_env_up) "
                    "and build the operator (see python/test.sh)")
    return v


def kubectl(*args: str, input: Optional[str] = None, check: bool = True) -> str:
    exe = os.environ.get("BATCHLEASE_KUBECTL", "kubectl")
    p = subprocess.run([exe, *args], input=input, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"({e})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A subprocess with its log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, name: str, argv: list, env: Optional[dict] = None) -> None:
        self.log = LOGS / f"{name}.log"
        self._f = open(self.log, "ab")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})}, cwd=str(HERE))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._f.close()


@pytest.fixture(scope="session")
def cluster() -> None:
    _need("KUBECONFIG")
    _need("BATCHLEASE_PG_URL")
    _need("BATCHLEASE_OPERATOR_BIN")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    for crd in ("batchtasks", "taskleases", "taskqueues"):
        kubectl("wait", "--for=condition=Established", "--timeout=60s",
                f"crd/{crd}.batchlease.dev")


class Env:
    """One test's namespace, its operator, and the workers it starts."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.procs: list = []

    def start_operator(self) -> Proc:
        port = free_port()
        op = Proc(f"{self.ns}-operator", [
            os.environ["BATCHLEASE_OPERATOR_BIN"],
            f"--namespaces={self.ns}",
            f"--metrics-addr=127.0.0.1:{port}",
            "--leader-election=true",
            "--leader-lease-name=batchlease-operator",
            f"--leader-lease-namespace={self.ns}",
            "--leader-lease-seconds=6",
            "--leader-grace-seconds=2",
            "--identity=op-0",
            "--events=all",
        ], env={"RUST_LOG": "info,kube=warn"})
        self.procs.append(op)
        self.operator = op
        return op

    def start_worker(self, queue: str, mode: str = "sync", slots: int = 1,
                     isolation: str = "process") -> Proc:
        w = Proc(f"{self.ns}-worker-{mode}-{isolation}-{len(self.procs)}", [
            sys.executable, str(HERE / "worker_main.py"), "--namespace", self.ns,
            "--queue", queue, "--mode", mode, "--slots", str(slots),
            "--isolation", isolation,
        ], env={"BATCHLEASE_LOG": "info,kube=warn,batchlease_worker_sdk=debug"})
        self.procs.append(w)
        return w

    def create_task(self, name: str, queue: str, payload: dict, lease_seconds: int = 10,
                    max_retries: int = 3) -> None:
        task = {
            "apiVersion": "batchlease.dev/v1alpha1",
            "kind": "BatchTask",
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "queue": queue,
                "payload": payload,
                "leaseDurationSeconds": lease_seconds,
                "maxRetries": max_retries,
                "backoff": {"initialSeconds": 1, "maxSeconds": 1, "multiplier": 1},
            },
        }
        kubectl("apply", "-f", "-", input=json.dumps(task))

    def task(self, name: str) -> dict:
        return json.loads(kubectl("get", "batchtask", name, "-n", self.ns, "-o", "json"))

    def diagnostics(self, name: str) -> str:
        parts = []
        try:
            parts.append(json.dumps(self.task(name).get("status"), indent=1))
        except Exception as e:  # noqa: BLE001 - diagnostics only
            parts.append(f"(task: {e})")
        parts.append(kubectl("get", "taskleases,events", "-n", self.ns, check=False))
        for p in self.procs:
            parts.append(f"--- {p.log} (exit {p.p.poll()})\n{tail(p.log)}")
        return "\n".join(parts)

    def wait_phase(self, name: str, phases: Iterable[str], timeout: float = 60) -> dict:
        """Polls the task until its phase is one of `phases`; fails with
        diagnostics at the deadline or when a process died."""
        phases = set(phases)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            t = self.task(name)
            last = (t.get("status") or {}).get("phase")
            if last in phases:
                return t
            dead = [p for p in self.procs if p.p.poll() is not None]
            if dead:
                pytest.fail(f"{dead[0].log} exited with {dead[0].p.poll()}\n{self.diagnostics(name)}")
            time.sleep(0.3)
        pytest.fail(f"task {name}: phase {last} after {timeout}s, wanted {sorted(phases)}\n"
                    f"{self.diagnostics(name)}")


@pytest.fixture
def env(cluster, request) -> Iterable[Env]:
    test = request.node.name.replace("_", "-").lower()[:30].strip("-")
    ns = f"py-{test}-{uuid.uuid4().hex[:5]}"
    kubectl("create", "namespace", ns)
    e = Env(ns)
    e.start_operator()
    try:
        yield e
    finally:
        for p in reversed(e.procs):
            p.stop()
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
