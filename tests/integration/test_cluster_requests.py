"""Two hosts on one PostgreSQL (Issue 47): one host's CLI drives a session another host owns, through
requests in the store, and follows it from the store.

Two kandev homes on this machine are the hosts ``a`` and ``b`` of one database (agent survival on, so
``b``'s agents outlive ``b``'s backend); every command runs on ``a``'s CLI, which talks to ``a``'s
backend only. Issue 47 scenario A: a session started on ``b`` from ``a`` runs its agent under ``b``'s control
server; ``a``'s prompt (with ``--follow``), cancel, stop and resume go through ``b``'s backend and
answer as on ``b`` itself, typed errors included. Issue 47 scenario B: ``b``'s backend SIGKILLed mid-turn;
``a`` refuses to drive the session with ``host_unreachable``; ``b`` restarted re-tracks the agent, the
turn completes, and ``a``'s follow shows every chunk once and in order.
"""

from __future__ import annotations

import json
import os
import re
import signal
from typing import Any

import psutil
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from tests.support.kandev import Kandev
from tests.support.processes import alive
from tests.support.streams import TimedOutput, agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(420)


HOST_TIMEOUT_S = 3


def _config(url: str, host: str) -> str:
    return (f'[database]\nurl = "{url}"\n[cluster]\nhost = "{host}"\nheartbeat_s = 1\n'
            f"host_timeout_s = {HOST_TIMEOUT_S}\n[features]\nagent_survival = true\n")


def _hosts(kandev_factory: Any, postgres: Any) -> tuple[Kandev, Kandev, str]:
    url = postgres.new_database()
    a = kandev_factory("a", _config(url, "a"))
    b = kandev_factory("b", _config(url, "b"))
    a.up()
    b.up()
    return a, b, url


def _host_row(k: Kandev, name: str) -> dict[str, Any]:
    """``kandev hosts``' row of host ``name``."""
    return next(h for h in k.cli("hosts")["hosts"] if h["name"] == name)


def _requests(url: str, op: str) -> list[Any]:
    """The cluster's request rows of ``op``, oldest first."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text("SELECT state, error FROM cluster_requests WHERE op = :op ORDER BY id"),
                                     {"op": op}))
    finally:
        engine.dispose()


def _host_of(url: str, sid: str) -> str | None:
    """The host the shared store records for the session."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT host FROM task_sessions WHERE id = :id"), {"id": sid}).scalar()
    finally:
        engine.dispose()


def _state(k: Kandev, sid: str, *states: str, timeout: float = 60) -> dict[str, Any]:
    return wait_until(lambda: s if (s := k.show(sid))["state"] in states else None, timeout=timeout,
                      message=f"session {sid} in {states}")


def _ancestors(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).parents()]


def _error(proc: Any) -> tuple[int, str]:
    """A failed CLI call's exit status and its error line (stderr)."""
    return proc.returncode, proc.stderr.strip()


def test_a_drives_a_session_on_b(kandev_factory, postgres):
    """Issue 47 scenario A: from ``a``: ``session start TASK --host b``, a prompt with ``--follow``,
    ``cancel``, ``session stop``, ``resume`` (and a permission answer, ``reset-context``); the agent's process runs under ``b``'s control server
    (never ``a``'s); each answer, and each typed error, is what ``b``'s own CLI gets; both boards
    show the same tasks and sessions with their hosts."""
    a, b, url = _hosts(kandev_factory, postgres)
    task = a.cli("task", "create", "--title", "on b")["task_id"]
    sid = a.cli("session", "start", task, "--host", "b")["session_id"]
    shown = _state(a, sid, "WAITING_FOR_INPUT")
    assert _host_of(url, sid) == "b"
    assert shown["on_this_host"] is False and b.show(sid)["on_this_host"] is True  # resume prepares on b
    pid = int(shown["agent_pid"])
    b.agent_pids.add(pid)
    b_server, a_server = int(b.status()["control_server"]["pid"]), int(a.status()["control_server"]["pid"])
    assert b_server in _ancestors(pid) and a_server not in _ancestors(pid)

    followed = a.human("prompt", sid, "hello from a", "--follow")
    assert followed.returncode == 0, followed.stderr
    assert "echo: hello from a" in followed.stdout and "turn ended" in followed.stdout
    assert agent_chunks(b.show(sid)) == ["echo: hello from a"]
    logs = a.cli("logs", sid)  # the agent's stderr is a file on b: b's backend reads it
    assert logs == b.cli("logs", sid) and "session/prompt" in logs["text"], logs
    follow_logs = a.popen("logs", sid, "-f")  # each ask waits on b for the file to change
    followed_logs = TimedOutput(follow_logs.stdout)

    started = a.cli("prompt", sid, "/slow 60")
    assert started["turn_id"]
    followed_logs.wait_for("text='/slow 60'", timeout=60)  # written by b's agent after -f started on a
    follow_logs.terminate()
    follow_logs.wait(timeout=10)
    wait_until(lambda: agent_chunks(a.show(sid))[1:], timeout=60, message="the slow turn streams")
    assert a.cli("cancel", sid) == {"ok": True} or a.cli("session", "show", sid)
    turn = wait_until(lambda: t if (t := a.show(sid)["turns"][-1])["state"] != "open" else None, timeout=60)
    assert turn["stop_reason"] == "cancelled", turn

    # The same typed error as on b itself: nothing to cancel now.
    from_a, from_b = a.run("cancel", sid), b.run("cancel", sid)
    assert from_a.returncode == from_b.returncode != 0
    assert json.loads(from_a.stdout or "{}") == json.loads(from_b.stdout or "{}")
    assert from_a.stderr == from_b.stderr and "conflict" in from_a.stderr, from_a.stderr

    stopped = a.cli("session", "stop", sid)
    assert stopped["session_id"] == sid and stopped["agent_pid"] == pid
    wait_until(lambda: not alive(pid), timeout=30, message="the stopped agent exits")
    resumed = a.cli("resume", sid)
    assert resumed["session_id"] == sid
    again = _state(a, sid, "WAITING_FOR_INPUT")
    new_pid = int(again["agent_pid"])
    b.agent_pids.add(new_pid)
    assert new_pid != pid and b_server in _ancestors(new_pid)
    assert a.cli("prompt", sid, "after resume", "--wait")["stop_reason"] == "end_turn"

    # A permission answer (ids as prefixes, resolved on a), twice: b's typed refusal with its details.
    a.cli("prompt", sid, "/permission")
    request = wait_until(lambda: next((p["request_id"] for p in a.show(sid).get("permissions") or []
                                       if p["state"] == "open"), None), timeout=30, message="a permission request")
    assert a.human("permission", sid[:8], request[:8], "--option", "allow").returncode == 0
    again = a.run("permission", sid, request, "--cancel")
    assert again.returncode != 0 and json.loads(again.stdout)["error"]["details"]["answer"] == "allow"
    wait_until(lambda: a.show(sid)["turns"][-1]["state"] != "open", timeout=60, message="the turn ends")
    reset = a.cli("session", "reset-context", sid)
    assert reset["session_id"] == sid and reset["state"] == "WAITING_FOR_INPUT", reset

    # Both boards show the same tasks in the same buckets, and the session with its host.
    assert a.cli("board") == b.cli("board")
    assert {t for ids in a.cli("board").values() for t in ids} == {task}
    rows_a = {s["session_id"]: s for s in a.cli("session", "list")["sessions"]}
    rows_b = {s["session_id"]: s for s in b.cli("session", "list")["sessions"]}
    assert rows_a.keys() == rows_b.keys() == {sid} and rows_a[sid]["host"] == rows_b[sid]["host"] == "b"

    # A local session of a is still driven by a alone.
    _, local = a.start_session("on a")
    assert _host_of(url, local) == "a"
    assert a.cli("prompt", local, "local", "--wait")["stop_reason"] == "end_turn"


def test_a_refuses_an_unreachable_b_and_follows_the_turn_once_b_is_back(kandev_factory, postgres):
    """Issue 47 scenario B (the part driven from ``a``): ``b``'s backend SIGKILLed mid-turn; the
    ``prompt --wait`` b was carrying out for ``a`` fails ``host_unreachable`` (it may have run), and
    ``b``'s next start answers it ``request_interrupted``, never running it twice; ``a`` refuses to
    drive ``b``'s session with ``host_unreachable`` naming ``b`` and since when; ``b`` restarted
    re-tracks the agent, the turn completes, and ``a``'s follow (open throughout) shows every chunk
    once and in order."""
    a, b, url = _hosts(kandev_factory, postgres)
    task = a.cli("task", "create", "--title", "b dies")["task_id"]
    sid = a.cli("session", "start", task, "--host", "b")["session_id"]
    pid = int(_state(a, sid, "WAITING_FOR_INPUT")["agent_pid"])
    b.agent_pids.add(pid)
    waiting = a.popen("prompt", sid, "/slow 30", "--wait", json_output=True)  # b carries it out, a waits
    follow = a.popen("follow", sid[:8], "--reconnect-timeout", "120")
    out, err = TimedOutput(follow.stdout), TimedOutput(follow.stderr)
    out.wait_for("3/30 ", timeout=60)

    backend = b.backend_pid
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    # The prompt b was carrying out: a stops waiting once b is unreachable, saying it may have run.
    assert waiting.wait(timeout=60) != 0
    answer = json.loads(waiting.stdout.read() if waiting.stdout else b"{}")["error"]
    assert answer["code"] == "host_unreachable" and "may or may not have taken effect" in answer["message"], answer
    seen = wait_until(lambda: h if (h := _host_row(a, "b"))["state"] == "unreachable" else None, timeout=30,
                      message="a shows b unreachable")
    code, line = _error(a.run("prompt", sid, "while b is away"))
    assert code != 0 and "host_unreachable" in line and f"host b is unreachable since {seen['since']}" in line, line
    code, line = _error(a.run("cancel", sid))
    assert code != 0 and "host_unreachable" in line, line
    assert alive(pid)  # the agent goes on under b's control server

    st = b.up()
    assert st["recovery"]["retracked"] == 1
    # b's new backend answered the request its predecessor had claimed; it never ran it again.
    (row,) = _requests(url, "prompt")
    assert row.state == "done" and row.error["code"] == "request_interrupted", row
    assert follow.wait(timeout=120) == 0, err.text
    assert re.findall(r"\d+/30 ", out.text) == [f"{i}/30 " for i in range(1, 31)]
    done = _state(a, sid, "WAITING_FOR_INPUT")
    assert agent_chunks(done) == [f"{i}/30 " for i in range(1, 31)]
    assert a.cli("prompt", sid, "b is back", "--wait")["stop_reason"] == "end_turn"


def test_a_proceeds_a_workflow_whose_session_is_on_b(kandev_factory, postgres):
    """Issue 47 item 2: ``task proceed`` from ``a`` on a task whose latest session runs on ``b``: the
    step's context reset and automatic prompt are carried out by ``b``'s backend (its agent), and
    the answer is what ``b`` gives."""
    a, b, _ = _hosts(kandev_factory, postgres)
    task = a.cli("task", "create", "--title", "steps on b", "--steps", "plan,implement:reset:prompt=Implement it")[
        "task_id"]
    sid = a.cli("session", "start", task, "--host", "b")["session_id"]
    b.agent_pids.add(int(_state(a, sid, "WAITING_FOR_INPUT")["agent_pid"]))
    entered = a.cli("task", "proceed", task)
    assert (entered["step"], entered["session_id"]) == ("implement", sid), entered
    assert entered["reset"]["session_id"] == sid and entered["prompt"] is not None, entered
    done = wait_until(lambda: s if (s := a.show(sid))["turns"][-1]["state"] != "open" else None, timeout=60)
    assert [m["text"] for m in done["transcript"] if m["kind"] == "prompt"][-1] == "Implement it"
    assert a.cli("task", "workflow", task)["current"] == "implement"
