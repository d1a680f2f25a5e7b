"""Issue 3 scenarios driven through real backends: adoption gates, rotation, crash points, cleanup.

A: two installations never adopt or stop each other's control server.
B: every adoption rotates the credential; the previous one is refused once confirmed.
C: a backend killed between rotate and confirm (and at the other crash points) leaves a
   credential held by both sides: the next backend adopts and re-tracks; nothing is stopped.
D: a backend that renews keeps its server alive past the unowned period; without one the
   server stops every agent and exits.
F: capability switched off: a provable survivor is stopped through ownership_shutdown and its
   rows repaired (resume token and worktree kept); an unprovable one is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.agentctl import launch as launch_file
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import OwnershipRefused
from ipc.errors import IpcError
from tests.support.kandev import Kandev, db_row
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


def _record(k: Kandev) -> dict[str, Any]:
    row = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")
    assert row is not None
    return row


def _inventory(k: Kandev, sid: str) -> dict[str, Any]:
    row = db_row(k, "SELECT * FROM executors_running WHERE session_id = ?", sid)
    assert row is not None
    return row


def _credential(k: Kandev, ref: str) -> bytes:
    return launch_file.read_credential_file(k.home / "secrets" / ref)


def _installation(k: Kandev) -> str:
    return (k.home / "installation-id").read_text().strip()


def _running_turn(k: Kandev, n: int = 60) -> tuple[str, str, int, float]:
    task, sid = k.start_session("own")
    k.cli("prompt", sid, f"/slow {n}")
    show = wait_until(lambda: s if agent_chunks(s := k.show(sid)) else None, timeout=30)
    return task, sid, show["agent_pid"], show["agent_pid_start_time"]


def _kill_backend(k: Kandev) -> None:
    pid = k.backend_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), timeout=10)


async def _try_drive(socket_path: str, credential: bytes, installation_id: str) -> str:
    """What a peer holding ``credential`` gets when it tries to drive the server."""
    try:
        client = await AgentctlClient.connect(socket_path, credential=credential, installation_id=installation_id)
    except OwnershipRefused as exc:
        return exc.reason
    except IpcError as exc:
        return exc.code
    try:
        await client.list_instances()
        return "accepted"
    except IpcError as exc:
        return exc.code
    finally:
        await client.close()


def test_scenario_a_two_installations_never_adopt_each_other(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.1, AC-EXECUTORS-CONTROL-OWNERSHIP-001.2, AC-EXECUTORS-CONTROL-OWNERSHIP-001.3,
    AC-EXECUTORS-CONTROL-OWNERSHIP-001.4, AC-EXECUTORS-CONTROL-OWNERSHIP-001.6, AC-EXECUTORS-SURVIVAL-005.6:
    identity mismatch → refuse, touch nothing, start own; the one record names the server in use."""
    one = kandev_factory("one", KANDEV_FEATURES_AGENT_SURVIVAL="true")
    two = kandev_factory("two", KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st1 = one.up()
    _, sid1, pid1, start1 = _running_turn(one)
    st2 = two.up()
    two.cli("down")
    os.kill(st2["control_server"]["pid"], signal.SIGTERM)
    wait_until(lambda: not alive(st2["control_server"]["pid"]), timeout=15)
    # Point installation two at installation one's socket.
    con = sqlite3.connect(two.home / "kandev.db")
    con.execute("UPDATE control_server_record SET endpoint = ?", (st1["control_server"]["endpoint"],))
    con.commit()
    con.close()
    st2b = two.up()
    assert st2b["adoption"] == {"outcome": "refused", "reason": "identity_mismatch"}
    assert st2b["control_server"]["endpoint"] != st1["control_server"]["endpoint"]
    assert _record(two)["endpoint"] == st2b["control_server"]["endpoint"]  # the record names the server in use
    # Even with the identity copied, two cannot prove it holds one's credential.
    two.cli("down")
    os.kill(st2b["control_server"]["pid"], signal.SIGTERM)
    wait_until(lambda: not alive(st2b["control_server"]["pid"]), timeout=15)
    con = sqlite3.connect(two.home / "kandev.db")
    con.execute(
        "UPDATE control_server_record SET endpoint = ?, server_identity = ?",
        (st1["control_server"]["endpoint"], st1["control_server"]["server_identity"]),
    )
    con.commit()
    con.close()
    st2c = two.up()
    assert st2c["adoption"] == {"outcome": "refused", "reason": "authentication_failure"}
    # Installation one's server and agent were never stopped.
    assert alive(st1["control_server"]["pid"]) and alive(pid1)
    show = one.show(sid1)
    assert show["state"] == "RUNNING" and show["agent_pid"] == pid1 and show["agent_pid_start_time"] == start1
    assert one.status()["control_server"]["state"] == "running"


def test_scenario_b_each_adoption_rotates_and_old_credential_is_refused(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.1, AC-EXECUTORS-CONTROL-OWNERSHIP-002.7: after confirm the superseded credential drives nothing."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    _, sid, pid, start = _running_turn(k)
    endpoint, installation = st["control_server"]["endpoint"], _installation(k)
    old_ref = _record(k)["credential_ref"]
    old = _credential(k, old_ref)
    assert asyncio.run(_try_drive(endpoint, old, installation)) == "accepted"
    _kill_backend(k)
    st2 = k.up()
    assert st2["adoption"]["outcome"] == "adopted"
    new_ref = _record(k)["credential_ref"]
    assert new_ref != old_ref
    assert not (k.home / "secrets" / old_ref).exists()
    new = _credential(k, new_ref)
    assert new != old
    assert asyncio.run(_try_drive(endpoint, old, installation)) in ("authentication_failure", "unauthenticated",
                                                                     "superseded_credential")
    assert asyncio.run(_try_drive(endpoint, new, installation)) == "accepted"
    show = k.show(sid)
    assert show["retracked"] and show["agent_pid"] == pid and show["agent_pid_start_time"] == start


@pytest.mark.parametrize("fault", ["adopt_after_rotate", "adopt_after_secret", "adopt_after_record"])
def test_scenario_c_killed_between_rotate_and_confirm(kandev_factory, fault):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.7, AC-EXECUTORS-CONTROL-OWNERSHIP-002.10: at every crash point a credential is held by both sides."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    _, sid, pid, start = _running_turn(k)
    _kill_backend(k)
    faulty = dict(k.env, KANDEV_FAULT=fault)
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
        capture_output=True, text=True, env=faulty, timeout=120, cwd=REPO_ROOT,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr  # it died at the fault point
    assert alive(st["control_server"]["pid"]) and alive(pid)  # nothing was stopped
    st3 = k.up()
    assert st3["adoption"]["outcome"] == "adopted"
    assert st3["control_server"]["pid"] == st["control_server"]["pid"]
    show = wait_until(lambda: s if (s := k.show(sid))["retracked"] else None, timeout=10)
    assert show["agent_pid"] == pid and show["agent_pid_start_time"] == start


def test_scenario_d_backend_renews_then_unowned_shutdown(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.1, AC-EXECUTORS-CONTROL-OWNERSHIP-003.2, AC-EXECUTORS-CONTROL-OWNERSHIP-003.5,
    AC-EXECUTORS-CONTROL-OWNERSHIP-001.8: renewed while owned; stops every agent once unowned; repaired next start."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_AGENTCTL_UNOWNED_PERIOD="1min")
    st = k.up()
    server = st["control_server"]["pid"]
    _, sid, pid, _ = _running_turn(k, n=600)
    # Owned for longer than one period: the backend's claims (every period/4) keep it alive.
    with pytest.raises(TimeoutError):
        wait_until(lambda: not alive(server), timeout=80)
    assert alive(pid)
    token = k.show(sid)["resume_token"]
    k.cli("down")  # detaches: nobody renews any more
    wait_until(lambda: not alive(server), timeout=90)
    wait_until(lambda: not alive(pid), timeout=10)
    # AC-EXECUTORS-CONTROL-OWNERSHIP-003.5: the next backend repairs the rows (nothing answers → pid probe).
    st2 = k.up()
    assert st2["adoption"] == {"outcome": "no_server", "reason": "no_answer"}
    row = _inventory(k, sid)
    assert row["status"] == "stale" and row["resume_token"] == token
    assert k.show(sid)["state"] != "RUNNING"


def test_scenario_f_disabled_stops_provable_survivor_and_repairs(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-005.5, AC-EXECUTORS-SURVIVAL-005.7, AC-EXECUTORS-SURVIVAL-001.7,
    AC-EXECUTORS-CONTROL-OWNERSHIP-002.9: the switch takes effect at the next start; ownership_shutdown, then repair."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    task, sid, pid, _ = _running_turn(k)
    token = k.show(sid)["resume_token"]
    workspace = _inventory(k, sid)["workspace_path"]
    k.cli("down")
    assert alive(pid)
    k.env["KANDEV_FEATURES_AGENT_SURVIVAL"] = "false"
    st2 = k.up()
    assert st2["capability"]["state"] == "disabled"
    wait_until(lambda: not alive(st["control_server"]["pid"]), timeout=30)
    wait_until(lambda: not alive(pid), timeout=10)
    row = _inventory(k, sid)
    assert row["status"] == "stale" and row["resume_token"] == token and row["workspace_path"] == workspace
    assert Path(workspace).is_dir()  # AC-EXECUTORS-SURVIVAL-001.7: the workspace is untouched
    show = k.show(sid)
    assert show["state"] != "RUNNING" and show["resume_token"] == token
    assert task not in k.cli("board")["running"]


def test_scenario_f_disabled_leaves_unprovable_server_running(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-005.5: a server the backend cannot prove is its own is left untouched."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    _, sid, pid, _ = _running_turn(k)
    k.cli("down")
    # Replace the stored credential: the survivor can no longer prove it holds ours.
    launch_file.write_credential(k.home / "secrets" / _record(k)["credential_ref"], os.urandom(32))
    k.env["KANDEV_FEATURES_AGENT_SURVIVAL"] = "false"
    k.up()
    assert alive(st["control_server"]["pid"]) and alive(pid)
    row = _inventory(k, sid)
    assert row["status"] == "live"  # liveness unknown: left untouched (AC-EXECUTORS-SURVIVAL-003.6)


def test_superseded_backend_stops_treating_the_executions_as_its_own(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.3: while a backend drives a server, another adopter (this
    test, holding the installation's credential) rotates. Phase 1 (not yet confirmed): the
    backend's next operation is refused as superseded; it drops every execution on that server,
    stops renewing and does not retry, and stops nothing (the agent is the new owner's). Phase 2
    (confirmed): the old credential authenticates nothing; the backend sends no retry."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_AGENTCTL_UNOWNED_PERIOD="1min")
    st = k.up()
    _, sid = k.start_session("superseded")
    pid = k.show(sid)["agent_pid"]
    rec = _record(k)
    old = _credential(k, rec["credential_ref"])
    log = k.home / "logs" / "backend.log"

    async def take_over() -> None:
        client = await AgentctlClient.connect(rec["endpoint"], credential=old, installation_id=_installation(k),
                                              purpose="adopt")
        try:
            rotation_id, new = await client.rotate()
            # phase 1: the backend's credential is superseded, not yet dead
            refused = await asyncio.to_thread(k.run, "prompt", sid, "hello")
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert json.loads(refused.stdout)["error"]["code"] == "superseded_credential", refused.stdout
            await client.reauthenticate(new)
            await client.confirm_rotation(rotation_id)  # phase 2
        finally:
            await client.close()

    asyncio.run(take_over())
    lost = wait_until(lambda: [line for line in log.read_text().splitlines() if "ownership_lost" in line], timeout=10)
    assert "reason=superseded_credential" in lost[0] and "1 execution(s) no longer tracked" in lost[0], lost
    show = k.show(sid)
    assert not show["live"]
    again = k.run("prompt", sid, "hello")
    assert again.returncode == 1  # typed refusal: the backend no longer drives it
    assert alive(pid) and alive(st["control_server"]["pid"])  # nothing stopped: not ours any more
    # no retry: past one claim interval (period/4 = 15 s) nothing more was tried on that server
    with pytest.raises(TimeoutError):
        wait_until(lambda: "ownership claim failed" in log.read_text() or "refused us" in log.read_text(),
                   timeout=20)
    assert len([line for line in log.read_text().splitlines() if "ownership_lost" in line]) == 1
