"""The one recovery deadline (AC-EXECUTORS-SURVIVAL-003.7) and the guards (AC-EXECUTORS-SURVIVAL-002.8), with real daemons.

Faults injected into the control server (``KANDEV_FAULT=<step>:<seconds>``, off by default):

- a slow ``rotate``: the adoption is still in flight when the deadline elapses; it is allowed
  to finish (never cancelled), re-tracks nothing, and every record without an outcome is not
  re-tracked with its instance stopped; the backend becomes ready.
- a slow ``list_instances``: enumeration does not complete by the deadline, so nothing is
  re-tracked and nothing is stopped (AC-EXECUTORS-SURVIVAL-002.12); the rows are left untouched (liveness unknown).

- a slow ``turn_statuses``: the records' bulk turn-status read is in flight when the deadline
  elapses; the deadline's stop removes the instance, the read comes back without it, and the
  session stays not re-tracked for ``deadline`` (never ``turn_status_failed``).

While recovery runs, a prompt for a guarded session is refused with a retryable
``session_guarded`` error.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from daemon.agentctl.client.connection import AgentctlClient
from tests.support.kandev import Kandev
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)
DEADLINE = {"KANDEV_AGENTCTL_RECOVERY_DEADLINE": "5s", "KANDEV_AGENTCTL_RECOVERY_READ_TIMEOUT": "500ms",
            "KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "1"}


def _survivor(k: Kandev) -> tuple[dict, str, str, int]:
    st = k.up()
    task, sid = k.start_session("deadline")
    k.cli("prompt", sid, "/slow 120")
    show = wait_until(lambda: s if agent_chunks(s := k.show(sid)) else None, timeout=30)
    pid = show["agent_pid"]
    backend = st["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    return st, task, sid, pid


def _start_backend(k: Kandev) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=k.env, cwd=REPO_ROOT,
    )
    k.backend_pids.add(proc.pid)
    return proc


def test_adoption_in_flight_at_deadline_retracks_nothing_and_stops(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-003.7: one bound from first contact; late adoption re-tracks nothing."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_slow_rotate:8", **DEADLINE)
    st, task, sid, pid = _survivor(k)
    st2 = k.up()
    assert st2["backend"]["state"] == "ready"
    assert st2["adoption"]["outcome"] == "adopted"  # finished, result recorded, never cancelled
    assert st2["recovery"]["retracked"] == 0
    assert st2["recovery"]["reasons"][sid] == "deadline"
    assert st2["recovery"]["duration_ms"] >= 5000
    wait_until(lambda: not alive(pid), timeout=30)  # its instance was stopped
    # The agent dies first; then the control server answers the stop and the backend repairs the
    # session (a few milliseconds later: asserting at the agent's death alone failed 1 run in 6).
    show = wait_until(lambda: s if (s := k.show(sid))["state"] != "RUNNING" else None, timeout=30)
    assert not show["retracked"]
    assert show["not_retracked_reason"] == "deadline"
    assert task not in k.cli("board")["running"]
    assert k.cli("session", "list")["sessions"][0]["retracked"] is False


def test_turn_status_read_in_flight_at_deadline_is_not_retracked_for_the_deadline(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-003.7: the bulk turn-status read is still in flight when D elapses. At D
    the session is not re-tracked for ``deadline`` and its instance is stopped; the read then comes
    back without the instance (the deadline's stop removed it), and that consequence does not
    replace the reason: it stays ``deadline``, never ``turn_status_failed``. Driven in this process
    with the backend's own recovery code against the real survivor, so that the read timeout can
    outlast D (the config's read-budget rule forbids that) and the read is in flight at D whatever
    the load; the server answers ``turn_statuses`` 8 s late (switched on once the survivor runs)."""
    from daemon.backend.recovery.adoption import Adopter
    from daemon.backend.recovery.recovery import Recovery
    from daemon.backend.state.executions import ExecutionStore
    from daemon.host.paths import Paths
    from daemon.store.db import Store, sqlite_url

    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    fault_file = k.home.parent / "deadline-faults"  # read again at every check, by the running server too
    k.env["KANDEV_FAULT_FILE"] = str(fault_file)
    _, _, sid, pid = _survivor(k)
    fault_file.write_text("agentctl_slow_turn_statuses:8\n")

    async def recover() -> tuple[dict[str, str], bool, dict[str, str], list[str]]:
        store = Store.open(sqlite_url(k.home / "kandev.db"))
        installation = (k.home / "installation-id").read_text().strip()
        adopter = Adopter(store, Paths.for_home(k.home), installation, read_timeout_s=30, read_retries=0)
        recovery = Recovery(store, ExecutionStore(), adopter, deadline_s=3, read_timeout_s=30, read_retries=0,
                            boot_id="test-boot")
        read_back = asyncio.Event()
        statuses = recovery._statuses

        class Watched:  # the recovery's own reader, telling the test when its read came back
            def __init__(self, client: AgentctlClient) -> None:
                self.reader = statuses(client)

            async def read(self, instance_id: str) -> Any:
                try:
                    return await self.reader.read(instance_id)
                finally:
                    read_back.set()

        recovery._statuses = Watched  # type: ignore[assignment,method-assign]

        async def no_own_server() -> AgentctlClient:
            raise AssertionError("the survivor was not adopted")

        def publish(ex: Any) -> None:
            raise AssertionError(f"session {ex.session_id} published after the deadline")

        client = None
        try:
            report, client = await recovery.recover(enabled=True, start_own_server=no_own_server, publish=publish)
            at_deadline = dict(report.not_retracked)
            in_flight = not read_back.is_set()
            await asyncio.wait_for(read_back.wait(), timeout=60)
            return at_deadline, in_flight, dict(report.not_retracked), report.retracked
        finally:
            if client is not None:
                await client.close()
            store.close()

    at_deadline, in_flight, after, retracked = asyncio.run(recover())
    assert in_flight  # the read was in flight when recovery ended at D
    assert at_deadline == {sid: "deadline"} and retracked == []
    assert after == {sid: "deadline"}  # not turn_status_failed: the read failed because D stopped the instance
    wait_until(lambda: not alive(pid), timeout=30)  # its instance was stopped


def test_enumeration_not_complete_at_deadline_stops_nothing(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-002.12, AC-EXECUTORS-SURVIVAL-003.7, AC-EXECUTORS-SURVIVAL-002.8,
    AC-EXECUTORS-SURVIVAL-003.6 (unknown rows untouched): nothing re-tracked, nothing stopped; guarded meanwhile."""
    # A 20 s deadline leaves a wide window to observe the guard from the CLI on a loaded machine.
    window = {"KANDEV_AGENTCTL_RECOVERY_DEADLINE": "20s", "KANDEV_AGENTCTL_RECOVERY_READ_TIMEOUT": "1s",
              "KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "1"}
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_slow_enumeration:40", **window)
    st, task, sid, pid = _survivor(k)
    proc = _start_backend(k)
    try:
        wait_until(lambda: (r := k.run("status")).returncode == 0
                   and json.loads(r.stdout)["backend"]["state"] == "recovering", timeout=30)
        refused = k.run("prompt", sid, "hello")
        assert refused.returncode == 1
        error = json.loads(refused.stdout)["error"]
        assert error["code"] == "session_guarded" and error["retryable"] is True, error
        wait_until(lambda: json.loads(k.run("status").stdout)["backend"]["state"] == "ready", timeout=60)
    finally:
        if proc.poll() is None:
            pass  # stopped by the fixture's cleanup (kandev down)
    st2 = k.status()
    assert st2["adoption"]["outcome"] == "adopted"
    assert st2["recovery"]["retracked"] == 0
    assert st2["recovery"]["reasons"][sid] == "enumeration_failed"
    assert alive(pid) and alive(st["control_server"]["pid"])  # nothing was stopped
    show = k.show(sid)
    assert not show["retracked"]
    assert show["guard"] is None  # the guard was released at the deadline
