"""Issue 11: a control-server crash never wedges the backend (real daemons, no service manager).

A: survival on (a detached control server), 3 sessions mid-``/slow``: ``kill -9`` of the control
   server -> within 5 s every session waits for input with its turn interrupted, the tasks are in
   ``needs_attention`` (``no agent``: since Issue 23 item 3, ``turn_finished`` before); a new control server runs (``kandev status``); a new session starts; ``kandev
   resume`` gives an interrupted session an agent again; the backend pid never changed.
C: survival off (the control server is the backend's child): the same.
D: a control server that dies at start every time (the ``agentctl_dies_at_start`` fault, read from
   ``$KANDEV_FAULT_FILE``): after the crash-loop limit the backend stays up and answers, ``kandev
   status`` and ``kandev doctor`` say ``gave_up`` and why, its CPU stays near idle; once the fault
   file is gone, ``kandev up`` brings a server back.
With ``features.auto_resume`` (on by default since Issue 46; A, C and D switch it off to resume by
hand) the interrupted sessions are resumed once the new server runs.

Issue 11 scenario B (real systemd) is tests/systemd/test_control_server_loss_systemd.py; the interleaved
control-server and backend SIGKILLs (item 5) are tests/integration/test_chaos_kills.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import psutil
import pytest

from tests.support.kandev import CliError, Kandev, db_row, mock_agents
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

N = 120  # /slow long enough that every turn is still open when the server is killed
pytestmark = pytest.mark.timeout(240)


def _slow_sessions(k: Kandev, count: int) -> list[tuple[str, str]]:
    sessions = []
    for i in range(count):
        task, sid = k.start_session(f"loss {i}")
        k.cli("prompt", sid, f"/slow {N}")
        sessions.append((task, sid))
    for _, sid in sessions:
        wait_until(lambda sid=sid: len(agent_chunks(k.show(sid))) >= 2, timeout=30)
    return sessions


def _truthful_in_store(k: Kandev, sids: list[str]) -> bool:
    """Read straight from the store (cheap enough to poll within the scenario's 5 s)."""
    for sid in sids:
        if db_row(k, "SELECT state FROM task_sessions WHERE id = ?", sid)["state"] != "WAITING_FOR_INPUT":
            return False
        if db_row(k, "SELECT count(*) AS n FROM turns WHERE session_id = ? AND state = 'open'", sid)["n"]:
            return False
    return True


def _new_server(k: Kandev, old_pid: int, timeout: float = 60) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        st = k.status()
        server = st["control_server"]
        return st if server["state"] == "running" and server["pid"] not in (None, old_pid) else None

    st = wait_until(running, timeout=timeout)
    k.server_pids.add(int(st["control_server"]["pid"]))
    return st


def _backend_log(k: Kandev) -> str:
    return (k.home / "logs" / "backend.log").read_text(errors="replace")


@pytest.mark.parametrize(("survival", "mode"), [("true", "detached"), ("false", "child")],
                         ids=["A-survival-detached", "C-survival-off-child"])
def test_scenarios_a_and_c_killed_control_server_is_replaced_and_sessions_are_truthful(
        kandev_factory, survival, mode):
    """Issue 11 scenario A (survival on, no service manager) and Issue 11 scenario C (survival off,
    child control server)."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL=survival, KANDEV_FEATURES_AUTO_RESUME="false")  # by hand
    st = k.up()
    assert st["control_server"]["mode"] == mode and st["control_server"]["state"] == "running"
    backend = st["backend"]["pid"]
    sessions = _slow_sessions(k, 3)
    sids = [sid for _, sid in sessions]
    before = {sid: k.show(sid) for sid in sids}
    old_ref = db_row(k, "SELECT credential_ref FROM control_server_record WHERE id = 1")["credential_ref"]
    server = st["control_server"]["pid"]

    killed = time.monotonic()
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: _truthful_in_store(k, sids), timeout=5.0, message="sessions truthful within 5 s")
    print(f"\n[{mode}] sessions truthful {time.monotonic() - killed:.2f} s after the kill")
    st2 = _new_server(k, server)
    print(f"[{mode}] new control server running {time.monotonic() - killed:.2f} s after the kill")

    server2 = st2["control_server"]
    assert st2["backend"]["pid"] == backend  # the backend was never restarted
    assert server2["mode"] == mode and server2["restarts"] == 1
    assert server2["last_loss"]["reason"] == "killed by signal SIGKILL"
    assert server2["endpoint"] != st["control_server"]["endpoint"]
    assert server2["server_identity"] != st["control_server"]["server_identity"]
    board = k.cli("board")
    for task, sid in sessions:
        show = k.show(sid)
        assert show["state"] == "WAITING_FOR_INPUT" and not show["live"]
        assert show["turns"][-1]["state"] == "abandoned" and show["turns"][-1]["stop_reason"] == "interrupted"
        assert show["resume_token"] == before[sid]["resume_token"]  # resumable: the token is kept
        why = show["interruption"]
        assert why["cause"] == "control_server_lost" and why["reason"] == "killed by signal SIGKILL"
        notes = [m for m in show["transcript"] if m["kind"] == "control_server_lost"]
        assert len(notes) == 1 and f"the last event received was seq {why['last_seq']}" in notes[0]["text"]
        assert why["last_seq"] >= max(m["seq"] or 0 for m in show["transcript"])
        assert task in board["needs_attention"]  # no agent (Issue 23 item 3; turn_finished before)
        assert not alive(before[sid]["agent_pid"])
    # One journal entry for the loss, with the reason; no per-retry warnings.
    log = _backend_log(k)
    lost = [line for line in log.splitlines() if " control_server_lost " in line]
    assert len(lost) == 1 and 'reason="killed by signal SIGKILL"' in lost[0], lost
    assert log.count("event stream for session") <= len(sids)
    assert len([line for line in log.splitlines() if " session_interrupted " in line]) == len(sids)
    # The new server has a fresh credential and record; the lost one's files are gone.
    rec = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")
    assert rec["endpoint"] == server2["endpoint"] and rec["pid"] == server2["pid"]
    assert rec["credential_ref"] != old_ref and not (k.home / "secrets" / old_ref).exists()
    assert not os.path.exists(st["control_server"]["endpoint"])

    # A new session on a new task works, and resume gives an interrupted session an agent again.
    _, fresh = k.start_session("after the loss")
    assert k.show(fresh)["live"]
    resumed = k.cli("resume", sids[0])
    assert resumed["state"] == "WAITING_FOR_INPUT" and resumed["loaded"]
    show = k.show(sids[0])
    assert show["live"] and alive(show["agent_pid"]) and show["interruption"] is None
    assert k.cli("prompt", sids[0], "hello again", "--wait")["stop_reason"] == "end_turn"
    # No orphan: the only mock agents of this home are the two live sessions'.
    assert mock_agents(k.home) == {show["agent_pid"], k.show(fresh)["agent_pid"]}
    assert k.backend_pid == backend


def test_auto_resume_gives_interrupted_sessions_an_agent_once_the_new_server_runs(kandev_factory):
    """Issue 11 item 3: with features.auto_resume, the sessions a lost control server
    interrupted are resumed through the resume path once a new server runs (RESUME-10)."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="false", KANDEV_FEATURES_AUTO_RESUME="true")
    st = k.up()
    sessions = _slow_sessions(k, 2)
    before = {sid: k.show(sid) for _, sid in sessions}
    os.kill(st["control_server"]["pid"], signal.SIGKILL)
    _new_server(k, st["control_server"]["pid"])
    for task, sid in sessions:
        show = wait_until(lambda sid=sid: s if (s := k.show(sid))["live"] else None, timeout=60)
        assert show["state"] == "WAITING_FOR_INPUT" and alive(show["agent_pid"])
        assert show["agent_pid"] != before[sid]["agent_pid"]
        assert show["resume_token"] == before[sid]["resume_token"]  # session/load of the same conversation
        resumed = [m for m in show["transcript"] if m["kind"] == "session_resumed"]
        assert resumed and '"automatic": true' in resumed[-1]["text"]
        assert task in k.cli("board")["turn_finished"]
    assert mock_agents(k.home) == {k.show(sid)["agent_pid"] for _, sid in sessions}


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_scenario_d_server_dying_at_start_gives_up_then_kandev_up_brings_one_back(kandev_factory, short_tmp):
    """Issue 11 scenario D: a control server that dies at start every time (fault injection): after
    the crash-loop limit (5 losses within 5 min) the backend stays up and answers, status and doctor
    say gave_up and why, its CPU stays near idle; once the fault is removed, kandev up brings a
    server back."""
    faults = short_tmp / "faults"
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT_FILE=str(faults),
                       KANDEV_FEATURES_AUTO_RESUME="false")  # resumed by hand
    st = k.up()
    backend = st["backend"]["pid"]
    task, sid = k.start_session("dies at start")
    faults.write_text("agentctl_dies_at_start\n")
    os.kill(st["control_server"]["pid"], signal.SIGKILL)
    gave_up = wait_until(lambda: s if (s := k.status())["control_server"]["state"] == "gave_up" else None,
                         timeout=120)
    server = gave_up["control_server"]
    assert gave_up["backend"]["pid"] == backend and gave_up["backend"]["state"] == "ready"
    assert server["losses_in_window"] == 5 and server["crash_loop"] == {"limit": 5, "window_s": 300.0}
    assert server["gave_up"]["at_start"]
    assert "exited with code -9 before it was ready" in server["gave_up"]["reason"]
    assert server["pid"] is None
    log = _backend_log(k)
    assert len([line for line in log.splitlines() if " control_server_lost " in line]) == 1
    assert len([line for line in log.splitlines() if " control_server_restart_failed " in line]) == 4
    assert len([line for line in log.splitlines() if " control_server_gave_up " in line]) == 1
    # Nothing piles up: the lost server's credential and each failed start's files were removed.
    assert list((k.home / "secrets").glob("agentctl-cred-*")) == []
    assert list((k.home / "agentctl").glob("launch-*.json")) == []

    # The session that lost its agent is truthful; the backend answers and refuses what needs a server.
    assert k.show(sid)["state"] == "WAITING_FOR_INPUT"
    with pytest.raises(CliError) as refused:
        k.start_session("no server")
    assert refused.value.code == 1 and "control_server_unavailable" in refused.value.stderr
    assert "gave up" in refused.value.stderr
    assert not [s for s in k.cli("session", "list")["sessions"] if s["state"] in ("STARTING", "RUNNING")]
    doctor = k.run("doctor")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert doctor.returncode == 1 and not checks["control_server"]["ok"]
    assert "gave up restarting it after 5 losses" in checks["control_server"]["detail"]
    assert "kandev up" in checks["control_server"]["hint"]

    # Near idle while it has given up: no restarts, no polling worth measuring.
    children = {p.pid for p in psutil.Process(backend).children()}
    cpu = _cpu_seconds(backend)
    window = time.monotonic()
    time.sleep(3.0)  # the measurement window itself (nothing to poll: idleness is the point)
    used = _cpu_seconds(backend) - cpu
    elapsed = time.monotonic() - window
    print(f"\nbackend CPU while gave_up: {used:.3f} s over {elapsed:.1f} s")
    assert used < 0.1 * elapsed
    assert {p.pid for p in psutil.Process(backend).children()} <= children

    # The fault removed, `kandev up` makes the running backend try again.
    faults.unlink()
    up = k.cli("up")
    assert up["retried"] and not up["started"] and up["pid"] == backend
    server = up["status"]["control_server"]
    assert server["state"] == "running" and server["pid"]
    k.server_pids.add(int(server["pid"]))
    _, fresh = k.start_session("after the fault")
    assert k.show(fresh)["live"]
    assert k.cli("resume", sid)["state"] == "WAITING_FOR_INPUT"


def test_passthrough_server_loss_is_handled_likewise_and_leaves_the_other_server_alone(kandev_factory):
    """Issue 11 item 3 ("the passthrough server likewise"): the backend's own child server of
    passthrough sessions is watched, its sessions made truthful and it is restarted; the survival
    server and its session are untouched."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FEATURES_AUTO_RESUME="false")  # by hand
    st = k.up()
    _, pt_sid = k.start_session("passthrough", "--passthrough")
    k.cli("prompt", pt_sid, f"/slow {N}")
    task = k.cli("task", "create", "--title", "survival session")["task_id"]
    other = k.cli("session", "start", task)["session_id"]
    k.cli("prompt", other, f"/slow {N}")
    wait_until(lambda: len(agent_chunks(k.show(pt_sid))) >= 2 and len(agent_chunks(k.show(other))) >= 2, timeout=30)
    passthrough = k.status()["control_server"]["passthrough"]
    assert passthrough["state"] == "running" and passthrough["pid"]
    os.kill(passthrough["pid"], signal.SIGKILL)
    wait_until(lambda: _truthful_in_store(k, [pt_sid]), timeout=5.0)
    st2 = wait_until(lambda: s if (s := k.status())["control_server"]["passthrough"]["pid"] not in
                     (None, passthrough["pid"]) else None, timeout=60)
    k.server_pids.add(int(st2["control_server"]["passthrough"]["pid"]))
    assert st2["control_server"]["passthrough"]["state"] == "running"
    assert st2["control_server"]["passthrough"]["last_loss"]["reason"] == "killed by signal SIGKILL"
    assert st2["control_server"]["pid"] == st["control_server"]["pid"] and st2["control_server"]["restarts"] == 0
    show = k.show(pt_sid)
    assert not show["live"] and show["interruption"]["cause"] == "control_server_lost"
    assert k.show(other)["state"] == "RUNNING" and k.show(other)["live"]  # the other server's session
    assert k.cli("resume", pt_sid)["state"] == "WAITING_FOR_INPUT"
    assert k.show(pt_sid)["live"] and k.show(pt_sid)["passthrough"]


def test_backend_started_while_the_server_dies_at_start_stays_up_and_keeps_trying(kandev_factory, short_tmp):
    """Issue 11 scenario D, at backend start: a control server that cannot be started does not stop
    the backend (startup recovery completes, the backend answers); status says why, and the link's
    next attempt once the fault is gone brings a server."""
    faults = short_tmp / "faults"
    faults.write_text("agentctl_dies_at_start\n")
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="false", KANDEV_FAULT_FILE=str(faults))
    st = k.up()
    server = st["control_server"]
    assert st["backend"]["state"] == "ready" and server["state"] in ("restarting", "gave_up")
    assert server["pid"] is None and server["last_loss"]["at_start"]
    assert "exited with code -9 before it was ready" in server["last_loss"]["reason"]
    assert " control_server_start_failed " in _backend_log(k)
    with pytest.raises(CliError) as refused:
        k.start_session("no server yet")
    assert "control_server_unavailable" in refused.value.stderr
    faults.unlink()
    st2 = wait_until(lambda: s if (s := k.status())["control_server"]["state"] in ("running", "gave_up") else None,
                     timeout=60)
    if st2["control_server"]["state"] == "gave_up":  # a slow machine used up the attempts first
        st2 = k.cli("up")["status"]
    assert st2["control_server"]["state"] == "running"
    k.server_pids.add(int(st2["control_server"]["pid"]))
    assert st2["backend"]["pid"] == st["backend"]["pid"]
    _, sid = k.start_session("server at last")
    assert k.show(sid)["live"]
