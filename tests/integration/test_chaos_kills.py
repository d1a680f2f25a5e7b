"""Issue 11 item 5: chaos. Control-server SIGKILLs interleaved with backend SIGKILLs.

Survival on, no service manager, three sessions streaming (``/slow`` and ``/flood``). Each round
kills something, then checks, once the backend has settled:

- no session RUNNING without a live agent, none STARTING (a ``session start`` in flight when the
  server dies ends FAILED, or it finished first and is then interrupted like the others);
- every interrupted session is resumable: ``kandev resume`` gives it an agent that runs;
- no orphan: every mock-agent process of this home is the agent of a live session.

Rounds: the control server alone; the backend alone (its agents survive and are re-tracked); the
backend, then the control server while no backend runs (startup recovery finds no server); the
control server with a ``session start`` in flight; the backend and, as soon as the new one is
ready, the control server. Then the streams are started again for the next round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.support.kandev import Kandev, db_row, mock_agents
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
PROMPTS = ("/slow 300", "/slow 300", "/flood 4000")


def _stream(k: Kandev, sids: list[str]) -> None:
    """Every session gets a streaming turn (those still streaming keep theirs)."""
    for sid, prompt in zip(sids, PROMPTS, strict=True):
        if k.show(sid)["state"] == "WAITING_FOR_INPUT":
            k.cli("prompt", sid, prompt)
    for sid in sids:
        wait_until(lambda sid=sid: (s := k.show(sid))["state"] != "WAITING_FOR_INPUT" or agent_chunks(s),
                   timeout=30)


def _server_pid(k: Kandev) -> int:
    st = wait_until(lambda: s if (s := k.status())["control_server"]["state"] == "running" else None, timeout=60)
    pid = int(st["control_server"]["pid"])
    k.server_pids.add(pid)
    return pid


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), timeout=10)


def _settled(k: Kandev) -> list[dict[str, Any]] | None:
    """Every session's view once no session claims an agent it does not have, else None."""
    shows = [k.show(s["session_id"]) for s in k.cli("session", "list")["sessions"]]
    for show in shows:
        if show["state"] == "STARTING":
            return None
        if show["state"] == "RUNNING" and not (show["live"] and alive(show["agent_pid"])):
            return None
    live = {show["agent_pid"] for show in shows if show["live"]}
    if mock_agents(k.home) - live:
        return None  # an agent no session accounts for (it may still be dying)
    return shows


def _check_and_heal(k: Kandev, label: str) -> None:
    """The invariants of the module docstring, then every interrupted session resumed."""
    try:
        shows = wait_until(lambda: _settled(k), timeout=30, message=f"{label}: settled")
    except TimeoutError:
        shows = [k.show(s["session_id"]) for s in k.cli("session", "list")["sessions"]]
        live = {show["agent_pid"] for show in shows if show["live"]}
        pytest.fail(f"{label}: not truthful: {[(s['session_id'][:6], s['state'], s['live']) for s in shows]}, "
                    f"orphans {mock_agents(k.home) - live}")
    _server_pid(k)  # a resume while the new server is still starting is refused as retryable: wait for it
    for show in shows:
        assert show["state"] != "STARTING", label
        if show["live"]:
            assert alive(show["agent_pid"]), label
            continue
        assert show["state"] in ("WAITING_FOR_INPUT", "FAILED"), (label, show["state"])
        if show["state"] == "FAILED" and show["resume_token"] is None:
            continue  # a start that never got an agent: nothing to resume (its task can start anew)
        resumed = k.cli("resume", show["session_id"])
        assert resumed["state"] == "WAITING_FOR_INPUT", label
        after = k.show(show["session_id"])
        assert after["live"] and alive(after["agent_pid"]), label
    live = {s["agent_pid"] for s in (k.show(x["session_id"]) for x in k.cli("session", "list")["sessions"])
            if s["live"]}
    assert mock_agents(k.home) == live, label


def test_chaos_control_server_and_backend_sigkills_interleaved(kandev_factory):
    """Issue 11 item 5 (chaos): after every kill, no session RUNNING without a live agent,
    none stuck STARTING, every interrupted session resumable, no orphan agent."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FEATURES_AUTO_RESUME="false")  # by hand
    k.up()
    sids = [k.start_session(f"chaos {i}")[1] for i in range(len(PROMPTS))]

    # 1. the control server alone
    _stream(k, sids)
    _kill(_server_pid(k))
    _check_and_heal(k, "server kill")

    # 2. the backend alone: the agents survive, the next backend re-tracks them
    _stream(k, sids)
    _kill(k.backend_pid)
    st = k.up()
    assert st["recovery"]["retracked"] == len(sids)
    _check_and_heal(k, "backend kill")

    # 3. the backend, then the control server while no backend runs
    _stream(k, sids)
    server = _server_pid(k)
    _kill(k.backend_pid)
    _kill(server)
    st = k.up()
    assert st["adoption"]["outcome"] == "no_server"
    _check_and_heal(k, "backend then server kill")

    # 4. the control server with a session start in flight
    _stream(k, sids)
    server = _server_pid(k)
    task = k.cli("task", "create", "--title", "in flight")["task_id"]
    starting = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "--home", str(k.home), "--json", "session", "start", task],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=k.env, cwd=REPO_ROOT,
    )
    try:
        wait_until(lambda: db_row(k, "SELECT id FROM task_sessions WHERE task_id = ?", task), timeout=30)
        _kill(server)
        out, err = starting.communicate(timeout=120)
    finally:
        if starting.poll() is None:
            starting.kill()
            starting.wait()
    in_flight = db_row(k, "SELECT id, state FROM task_sessions WHERE task_id = ?", task)
    print(f"\nsession start in flight: rc={starting.returncode} -> {in_flight['state']} {err.strip()[:200]}")
    if starting.returncode != 0:
        assert in_flight["state"] == "FAILED"  # never left STARTING
    _check_and_heal(k, "server kill with a start in flight")

    # 5. the backend, and the control server as soon as the new backend is ready
    _stream(k, sids)
    _kill(k.backend_pid)
    k.up()
    _kill(_server_pid(k))
    _check_and_heal(k, "backend kill then server kill")

    log = (k.home / "logs" / "backend.log").read_text(errors="replace")
    assert log.count(" control_server_lost ") == 3  # rounds 1, 4 and 5 (3 had no backend to see it)
