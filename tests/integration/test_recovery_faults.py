"""Recovery when the control server misbehaves, with real daemons and injected faults.

The faults (``KANDEV_FAULT``, off by default) are inherited by the control server
that the first backend starts, so they act during the next backend's recovery.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from typing import Any

import pytest

from tests.support.kandev import Kandev, db_row
from tests.support.processes import alive, group_alive
from tests.support.sessions import agentctl_caller
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(240)
MOCK = [sys.executable, "-m", "daemon.agents.mock"]


def _kill_backend(k: Kandev) -> None:
    pid = k.backend_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), timeout=10)


def _running(k: Kandev) -> tuple[str, str, dict[str, Any]]:
    task, sid = k.start_session("faults")
    k.cli("prompt", sid, "/slow 120")
    show = wait_until(lambda: s if agent_chunks(s := k.show(sid)) else None, timeout=30)
    return task, sid, show


def test_unstoppable_duplicate_keeps_the_session_guarded(kandev_factory, short_tmp):
    """AC-EXECUTORS-SURVIVAL-002.15, AC-EXECUTORS-SURVIVAL-002.16: a loser that cannot be stopped
    means the winner is not re-tracked either; the session stays guarded, launches refused non-retryably."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_stop_fails")
    k.up()
    _, sid, show = _running(k)
    _kill_backend(k)
    workspace = short_tmp / "ws"
    workspace.mkdir()
    for_agent(workspace)
    extra = agentctl_caller(k)(lambda c: c.create_instance(session_id=sid, task_id=show["task_id"], command=MOCK,
                                                cwd=str(workspace)))
    k.agent_pids.add(extra["pid"])
    st = k.up()
    assert st["recovery"]["retracked"] == 0
    assert st["recovery"]["reasons"][sid] == "duplicate_stop_failed"
    after = k.show(sid)
    assert not after["retracked"] and after["guard"] == "unstopped_agent"
    refused = k.run("prompt", sid, "hello")
    error = json.loads(refused.stdout)["error"]
    assert refused.returncode == 1 and error["code"] == "session_guarded" and error["retryable"] is False
    assert alive(show["agent_pid"]) and alive(extra["pid"])  # the failure is recorded, nothing pretends


def test_failed_turn_status_read_is_stopped_not_published_running(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-004.5: a turn-status read that fails → not re-tracked, stopped, repaired."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_turn_status_fails")
    k.up()
    task, sid, show = _running(k)
    _kill_backend(k)
    st = k.up()
    assert st["recovery"]["retracked"] == 0
    assert st["recovery"]["reasons"][sid] == "turn_status_failed"
    wait_until(lambda: not group_alive(show["agent_pid"]), timeout=20)
    after = wait_until(lambda: s if (s := k.show(sid))["state"] != "RUNNING" else None, timeout=20)
    assert not after["retracked"] and after["resume_token"] == show["resume_token"]
    assert task not in k.cli("board")["running"]


def test_incompatible_server_is_stopped_and_rows_repaired_at_once(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-004.1, AC-EXECUTORS-CONTROL-OWNERSHIP-004.2,
    AC-EXECUTORS-CONTROL-OWNERSHIP-004.3, AC-EXECUTORS-CONTROL-OWNERSHIP-004.4,
    AC-EXECUTORS-CONTROL-OWNERSHIP-004.5: a proven own server lacking a required capability is stopped with
    ownership_shutdown, its rows repaired immediately (resume token kept), and a new server started."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_lacks_turns")
    st = k.up()
    _, sid, show = _running(k)
    _kill_backend(k)
    st2 = k.up()
    assert st2["adoption"] == {"outcome": "refused", "reason": "capability_incompatibility"}
    wait_until(lambda: not alive(st["control_server"]["pid"]), timeout=30)
    wait_until(lambda: not group_alive(show["agent_pid"]), timeout=10)
    assert st2["control_server"]["endpoint"] != st["control_server"]["endpoint"]
    rec = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")
    assert rec["endpoint"] == st2["control_server"]["endpoint"]
    row = db_row(k, "SELECT * FROM executors_running WHERE session_id = ?", sid)
    assert row["status"] == "stale" and row["resume_token"] == show["resume_token"]
    assert k.show(sid)["state"] != "RUNNING"


@pytest.mark.parametrize("fault", ["agentctl_shutdown_fails", "agentctl_lacks_shutdown"])
def test_incompatible_server_that_cannot_be_stopped_is_left_alone(kandev_factory, fault):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-004.7: failed whole-server stop → no row repaired, own server on a
    new endpoint, record rewritten, credential kept, survivor left to its unowned shutdown.
    AC-EXECUTORS-CONTROL-OWNERSHIP-004.6: a server that answers identity but does not support
    ownership_shutdown (``unknown_op``) is the same failed stop."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT=f"agentctl_lacks_turns,{fault}")
    st = k.up()
    _, sid, show = _running(k)
    old_ref = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")["credential_ref"]
    _kill_backend(k)
    st2 = k.up()
    assert st2["adoption"] == {"outcome": "refused", "reason": "capability_incompatibility"}
    assert alive(st["control_server"]["pid"]) and alive(show["agent_pid"])
    assert db_row(k, "SELECT * FROM control_server_record WHERE id = 1")["endpoint"] == st2["control_server"]["endpoint"]
    assert (k.home / "secrets" / old_ref).exists()
    assert db_row(k, "SELECT * FROM executors_running WHERE session_id = ?", sid)["status"] == "live"  # untouched


def test_credential_unavailable_refuses_keeps_secret_and_rewrites_record(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.9, AC-EXECUTORS-CONTROL-OWNERSHIP-001.6,
    AC-EXECUTORS-SURVIVAL-005.6: nothing sent, nothing recovered, the secret stays, the record names the new server."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    _, sid, show = _running(k)
    ref = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")["credential_ref"]
    secret = k.home / "secrets" / ref
    _kill_backend(k)
    os.chmod(secret, 0o644)  # unreadable by our rules: not 0600
    st2 = k.up()
    assert st2["adoption"] == {"outcome": "refused", "reason": "credential_unavailable"}
    assert st2["recovery"]["retracked"] == 0
    assert secret.exists()
    assert alive(st["control_server"]["pid"]) and alive(show["agent_pid"])  # not foreign, but not ours to stop
    assert db_row(k, "SELECT * FROM control_server_record WHERE id = 1")["endpoint"] == st2["control_server"]["endpoint"]
    assert db_row(k, "SELECT * FROM executors_running WHERE session_id = ?", sid)["status"] == "live"  # unknown


def test_single_instance_with_another_instance_id_is_retracked(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-002.2: one live instance reporting the session is re-tracked even when its
    instance id differs from the record's agent execution id."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    k.up()
    _, sid, show = _running(k)
    _kill_backend(k)
    con = sqlite3.connect(k.home / "kandev.db")
    con.execute("UPDATE executors_running SET instance_id = 'from-an-older-launch' WHERE session_id = ?", (sid,))
    con.commit()
    con.close()
    k.up()
    after = k.show(sid)
    assert after["retracked"] and after["agent_pid"] == show["agent_pid"]
    assert after["instance_id"] == show["instance_id"]


def test_rotation_failure_is_an_incomplete_adoption(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.5: the survivor answers ``rotate`` with an error: adoption
    is incomplete, nothing is recovered, no further operation reaches that server (it enumerates
    and stops nothing: its agent runs on), the credential both sides hold is kept, and the rows
    are left as they were (liveness unknown)."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_rotate_fails")
    st = k.up()
    _, sid, show = _running(k)
    ref = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")["credential_ref"]
    _kill_backend(k)
    server_log = k.home / "logs" / "agentctl.log"
    mark = len(server_log.read_text())
    st2 = k.up()
    assert st2["adoption"] == {"outcome": "refused", "reason": "credential_rotation_failure"}
    assert st2["recovery"]["retracked"] == 0
    assert alive(st["control_server"]["pid"]) and alive(show["agent_pid"])
    assert (k.home / "secrets" / ref).exists()  # the credential held by both sides is not thrown away
    assert db_row(k, "SELECT * FROM executors_running WHERE session_id = ?", sid)["status"] == "live"  # unknown
    assert not k.show(sid)["retracked"]
    after = server_log.read_text()[mark:]  # both servers of this home log here
    assert "instance_stopped" not in after and "ownership_shutdown" not in after, after[-3000:]
    assert k.status()["control_server"]["pid"] != st["control_server"]["pid"]  # not driven: a server of its own
