"""The one recovery deadline (AC-EXECUTORS-SURVIVAL-003.7) and the guards (AC-EXECUTORS-SURVIVAL-002.8), with real daemons.

Faults injected into the control server (``KANDEV_FAULT=<step>:<seconds>``, off by default):

- a slow ``rotate``: the adoption is still in flight when the deadline elapses; it is allowed
  to finish (never cancelled), re-tracks nothing, and every record without an outcome is not
  re-tracked with its instance stopped; the backend becomes ready.
- a slow ``list_instances``: enumeration does not complete by the deadline, so nothing is
  re-tracked and nothing is stopped (AC-EXECUTORS-SURVIVAL-002.12); the rows are left untouched (liveness unknown).

While recovery runs, a prompt for a guarded session is refused with a retryable
``session_guarded`` error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

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
    show = k.show(sid)
    assert not show["retracked"] and show["state"] != "RUNNING"
    assert show["not_retracked_reason"] == "deadline"
    assert task not in k.cli("board")["running"]
    assert k.cli("session", "list")["sessions"][0]["retracked"] is False


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
