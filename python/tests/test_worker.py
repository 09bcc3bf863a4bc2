"""The Python package against the real control plane, operator and
PostgreSQL: each test its own namespace, operator and worker process."""

from __future__ import annotations

import os
import time

import psycopg
import pytest


def status(t: dict) -> dict:
    return t.get("status") or {}


def test_sync_handler_succeeds_with_its_result_and_the_payload(env):
    env.start_worker("q")
    payload = {"action": "echo", "n": 3, "nested": {"list": [1, "two", None]}}
    env.create_task("echo", "q", payload)
    t = env.wait_phase("echo", {"Succeeded"})
    result = status(t)["result"]
    assert result["echo"] == payload, result
    assert result["attempt"] == 1 and result["name"] == "echo"
    assert result["token"] == status(t)["fencingToken"]


def test_retryable_error_then_success_with_the_checkpoint_carried(env):
    env.start_worker("q")
    env.create_task("flaky", "q", {"action": "retry_once"})
    t = env.wait_phase("flaky", {"Succeeded"}, timeout=90)
    s = status(t)
    assert s["result"] == {"attempt": 2, "resumedFrom": {"step": 7}}, s
    # `attempts` counts attempts that spent the retry budget; the token
    # counts leases issued.
    assert s["attempts"] == 1 and s["fencingToken"] == 2, s


def test_permanent_error_dead_letters(env):
    env.start_worker("q")
    env.create_task("bad", "q", {"action": "permanent"})
    t = env.wait_phase("bad", {"DeadLettered"})
    s = status(t)
    assert s["lastFailure"]["reason"] == "BadInput", s
    assert "never work" in s["lastFailure"]["message"], s
    assert s["attempts"] == 1 and s["fencingToken"] == 1, s


def test_other_exceptions_are_retryable_named_for_their_class(env):
    env.start_worker("q")
    env.create_task("crash", "q", {"action": "crash"}, max_retries=0)
    t = env.wait_phase("crash", {"DeadLettered"})
    s = status(t)
    assert s["lastFailure"]["reason"] == "ValueError", s
    assert "not a number" in s["lastFailure"]["message"], s


def test_async_handler_succeeds(env):
    env.start_worker("q", mode="async")
    env.create_task("aio", "q", {"action": "echo", "k": "v"})
    t = env.wait_phase("aio", {"Succeeded"})
    result = status(t)["result"]
    assert result["async"] is True and result["echo"] == {"action": "echo", "k": "v"}, result


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_handler_spinning_in_pure_python_for_two_ttls_keeps_its_lease(env, isolation):
    # TTL 5 s (the minimum): the kill switch would fire after 3.3 s without
    # renewals; the handler spins for 10 s. On a thread it holds the
    # worker's GIL (renewals run on a Rust thread that never takes it).
    env.start_worker("q", isolation=isolation)
    env.create_task("spin", "q", {"action": "spin", "seconds": 10}, lease_seconds=5)
    t = env.wait_phase("spin", {"Succeeded", "DeadLettered"}, timeout=60)
    s = status(t)
    assert s["phase"] == "Succeeded", env.diagnostics("spin")
    # One lease issued, none failed: the lease was renewed throughout.
    assert s["fencingToken"] == 1 and s["attempts"] == 0, s
    assert s["result"] == {"spins": True, "attempt": 1, "cancelled": False}, s


def test_fenced_psycopg_write_of_the_live_attempt(env):
    env.start_worker("q")
    env.create_task("fenced", "q", {"action": "fenced_write"})
    t = env.wait_phase("fenced", {"Succeeded"})
    s = status(t)
    token = s["fencingToken"]
    assert s["result"] == {"written": token, "wrongTokenRefused": "LF003"}, s
    with psycopg.connect(os.environ["BATCHLEASE_PG_URL"]) as conn:
        row = conn.execute("SELECT token FROM py_fenced_out WHERE task = %s",
                           (t["metadata"]["uid"],)).fetchone()
    assert row == (token,), row


def test_the_kill_switch_cancels_an_async_handler(env, tmp_path):
    # The task is deleted while its handler awaits: the next renewal finds
    # the lease gone (404), the kill switch fires, and the handler's
    # asyncio task is cancelled.
    marker = tmp_path / "cancelled"
    env.start_worker("q", mode="async")
    env.create_task("doomed", "q", {"action": "sleep", "seconds": 300, "marker": str(marker)})
    env.wait_phase("doomed", {"Running"})
    kubectl_delete = __import__("conftest").kubectl
    kubectl_delete("delete", "batchtask", "doomed", "-n", env.ns, "--wait=false")
    deadline = time.monotonic() + 30
    while not marker.exists():
        if time.monotonic() > deadline:
            pytest.fail("the async handler was not cancelled\n" + env.diagnostics("doomed"))
        time.sleep(0.2)
    assert marker.read_text() == "cancelled 1 True"


def test_the_kill_switch_kills_a_sync_handler_s_process(env, tmp_path):
    # A sync handler that never checks anything: deleting its task makes
    # the next renewal find the lease gone, the kill switch fires, and the
    # child process running the handler is killed.
    pidfile = tmp_path / "pid"
    worker = env.start_worker("q")
    env.create_task("hung", "q", {"action": "hang", "pidfile": str(pidfile)})
    env.wait_phase("hung", {"Running"})
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        if time.monotonic() > deadline:
            pytest.fail("the handler did not start\n" + env.diagnostics("hung"))
        time.sleep(0.2)
    pid = int(pidfile.read_text())
    assert pid != worker.p.pid
    __import__("conftest").kubectl("delete", "batchtask", "hung", "-n", env.ns, "--wait=false")
    deadline = time.monotonic() + 30
    while _alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"handler process {pid} still alive\n" + env.diagnostics("hung"))
        time.sleep(0.2)
    # The worker itself lives on and serves the next task.
    env.create_task("after", "q", {"action": "echo"})
    t = env.wait_phase("after", {"Succeeded"})
    assert status(t)["result"]["attempt"] == 1


def _wait_pids(env, name: str, pidfile) -> tuple:
    deadline = time.monotonic() + 30
    while not pidfile.exists() or len(pidfile.read_text().split()) != 2:
        if time.monotonic() > deadline:
            pytest.fail("the handler did not start\n" + env.diagnostics(name))
        time.sleep(0.2)
    handler, sub = (int(x) for x in pidfile.read_text().split())
    return handler, sub


def _wait_gone(env, name: str, pid: int, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"{what} {pid} still alive after {seconds} s\n" + env.diagnostics(name))
        time.sleep(0.05)


def test_the_kill_switch_kills_what_a_sync_handler_started(env, tmp_path):
    # The handler starts `sleep 600` (as it would start psql or ffmpeg) and
    # hangs. The kill switch signals the handler's whole process group, so
    # the subprocess dies with it: the same SIGKILL, reaped within 2 s.
    pidfile = tmp_path / "pids"
    env.start_worker("q")
    env.create_task("hung-sub", "q", {"action": "subprocess_hang", "pidfile": str(pidfile)})
    env.wait_phase("hung-sub", {"Running"})
    handler, sub = _wait_pids(env, "hung-sub", pidfile)
    assert _alive(sub)
    __import__("conftest").kubectl("delete", "batchtask", "hung-sub", "-n", env.ns, "--wait=false")
    _wait_gone(env, "hung-sub", handler, "handler process", 30)
    _wait_gone(env, "hung-sub", sub, "the handler's subprocess", 2)


def test_a_subprocess_left_running_by_a_handler_that_returned_is_killed(env, tmp_path):
    # The handler returns while its subprocess runs on: nothing of an
    # attempt may outlive it, so the subprocess is gone by the time the
    # task is Succeeded (killed before the result is handed to the SDK).
    pidfile = tmp_path / "pids"
    env.start_worker("q")
    env.create_task("left", "q", {"action": "subprocess_return", "pidfile": str(pidfile)})
    t = env.wait_phase("left", {"Succeeded"})
    sub = status(t)["result"]["subprocess"]
    assert not _alive(sub), f"subprocess {sub} outlived its attempt\n" + env.diagnostics("left")
    # The worker serves the next task (with a fresh child: the old one's
    # group was killed).
    env.create_task("next", "q", {"action": "echo"})
    assert status(env.wait_phase("next", {"Succeeded"}))["result"]["attempt"] == 1


def test_a_child_that_left_nothing_behind_is_reused(env):
    # The cheap path stays cheap: the same child process runs consecutive
    # attempts when they leave no process behind.
    env.start_worker("q")
    env.create_task("pid-1", "q", {"action": "pid"})
    first = status(env.wait_phase("pid-1", {"Succeeded"}))["result"]["pid"]
    env.create_task("pid-2", "q", {"action": "pid"})
    second = status(env.wait_phase("pid-2", {"Succeeded"}))["result"]["pid"]
    assert first == second


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_the_example_worker_runs_a_task(env):
    # examples/python-worker/worker.py as documented: --namespace --queue
    # --slots, the database from BATCHLEASE_PG_URL.
    import conftest
    import sys

    ex = conftest.REPO / "examples" / "python-worker" / "worker.py"
    env.procs.append(conftest.Proc(f"{env.ns}-example", [
        sys.executable, str(ex), "--namespace", env.ns, "--queue", "demo", "--slots", "2",
    ]))
    env.create_task("example", "demo", {"steps": 3, "stepMillis": 50})
    t = env.wait_phase("example", {"Succeeded"})
    s = status(t)
    assert s["result"] == {"steps": 3, "resumedFrom": 0, "token": s["fencingToken"],
                           "committed": True}, s
    with psycopg.connect(os.environ["BATCHLEASE_PG_URL"]) as conn:
        row = conn.execute("SELECT token, steps FROM python_worker_results WHERE task_uid = %s",
                           (t["metadata"]["uid"],)).fetchone()
    assert row == (s["fencingToken"], 3), row


def test_spawn_children_and_read_their_results(env):
    env.start_worker("q", slots=2)
    env.create_task("parent", "q", {"action": "spawn"})
    t = env.wait_phase("parent", {"Succeeded"})
    children = status(t)["result"]["children"]
    assert len(children) == 2, children
    for name in children:
        env.wait_phase(name, {"Succeeded"})
    second = env.task(children[1])
    assert children[0] in second["spec"].get("dependsOn", []), second["spec"]
    # A task depending on both reads their results.
    import json
    import conftest
    reader = {
        "apiVersion": "batchlease.dev/v1alpha1", "kind": "BatchTask",
        "metadata": {"name": "reader", "namespace": env.ns},
        "spec": {"queue": "q", "payload": {"action": "read_deps"}, "dependsOn": children},
    }
    conftest.kubectl("apply", "-f", "-", input=json.dumps(reader))
    r = status(env.wait_phase("reader", {"Succeeded"}))["result"]
    assert set(r["deps"]) == set(children), r
    assert all(v["echo"] == {"action": "echo"} for v in r["deps"].values()), r


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_drains_the_worker_running_tasks_finish(env, sig):
    import signal

    worker = env.start_worker("q")
    env.create_task("nap", "q", {"action": "nap", "seconds": 1.5})
    env.wait_phase("nap", {"Running"})
    worker.p.send_signal(getattr(signal, sig))
    # The drain grace is 2 s in worker_main: the running nap finishes.
    rc = worker.p.wait(timeout=20)
    assert rc == 0, f"worker exited {rc}\n" + env.diagnostics("nap")
    # Its exit is expected: not a death for wait_phase to report.
    env.procs.remove(worker)
    worker.stop()
    t = env.wait_phase("nap", {"Succeeded"}, timeout=10)
    assert status(t)["result"] == {"napped": True, "cancelled": False}
    log = worker.log.read_text(errors="replace")
    assert "Traceback" not in log, log
    assert "worker stopped" in log, log
