"""Several hosts on one PostgreSQL (Issue 47): two or three kandev homes on this machine, each a host
of one cluster on a real PostgreSQL server the tests start (pytest-xprocess).

A second backend of a live host name is refused naming the other's pid and machine; a single host
and a cluster cannot share a database; each backend drives, recovers and re-tracks only its own
host's sessions; a host whose backend was SIGKILLed is shown unreachable by the others (its
session's last known state, never live) and re-tracks its agent itself when it returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(420)

HEARTBEAT_S = 2
HOST_TIMEOUT_S = 8  # room for a heartbeat late on a busy machine (a live host never looks unreachable)


def _config(url: str, host: str | None, *, survival: bool = True, password_file: str | None = None) -> str:
    cluster = (f'[cluster]\nhost = "{host}"\nheartbeat_s = {HEARTBEAT_S}\nhost_timeout_s = {HOST_TIMEOUT_S}\n'
               if host else "")
    password = f'password_file = "{password_file}"\n' if password_file else ""
    return (f'[database]\nurl = "{url}"\n{password}[features]\nagent_survival = {"true" if survival else "false"}\n'
            + cluster)


def _backend(k: Kandev) -> subprocess.CompletedProcess[str]:
    """A backend of home ``k`` run in the foreground (for a start that is refused)."""
    return subprocess.run([sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
                          capture_output=True, text=True, env=k.env, timeout=120, cwd=REPO_ROOT)


def _hosts(k: Kandev) -> dict[str, dict[str, Any]]:
    return {h["name"]: h for h in k.cli("hosts")["hosts"]}


def _session_row(k: Kandev, sid: str) -> dict[str, Any]:
    return next(s for s in k.cli("session", "list")["sessions"] if s["session_id"] == sid)


def test_a_second_backend_of_a_live_host_name_is_refused(kandev_factory, postgres):
    """Issue 47 scenario D: with host b running, a second backend (another home) with
    cluster.host = "b" is refused naming b's pid and machine, before it logs anything; host c starts
    beside b; a single-host backend is refused on the cluster's database (Issue 47 scenario E's
    refusal of a second backend on one store, kept), and so is a cluster host on a single host's.
    A host stopped cleanly is shown stopped (Issue 47 item 4)."""
    url = postgres.new_database()
    b = kandev_factory("b", _config(url, "b", survival=False))
    st = b.up()
    assert st["cluster"]["host"] == "b" and st["cluster"]["ready"] == ["b"], st["cluster"]
    second = kandev_factory("b2", _config(url, "b", survival=False))
    proc = _backend(second)
    assert proc.returncode == 1, proc.stderr
    assert f"pid {st['backend']['pid']} on machine {os.uname().nodename}" in proc.stderr, proc.stderr
    assert "cluster host 'b'" in proc.stderr and not (second.home / "logs" / "backend.log").exists()

    single = kandev_factory("single", _config(url, None, survival=False))
    proc = _backend(single)
    assert proc.returncode == 1 and "the hosts of a cluster (b)" in proc.stderr, proc.stderr

    c = kandev_factory("c", _config(url, "c", survival=False))
    assert c.up()["cluster"]["host"] == "c"
    assert {(n, h["state"], h["own"]) for n, h in _hosts(c).items()} == {("b", "ready", False), ("c", "ready", True)}
    assert b.cli("status")["backend"]["pid"] == st["backend"]["pid"]  # b was not disturbed
    c.run("down")  # a clean stop: stopped, not unreachable
    assert _hosts(b)["c"]["state"] == "stopped" and "c" in b.cli("status")["cluster"]["stopped"]
    assert "stopped" in b.human("hosts").stdout

    lone = postgres.new_database()
    kandev_factory("lone", _config(lone, None, survival=False)).up()
    joiner = kandev_factory("joiner", _config(lone, "j", survival=False))
    proc = _backend(joiner)
    assert proc.returncode == 1 and "already uses this PostgreSQL database as a single host" in proc.stderr, \
        proc.stderr


def test_a_killed_host_is_unreachable_to_the_others_and_retracks_its_own_agent(kandev_factory, postgres):
    """Issue 47 scenario B (the unreachable part) and item 1: host a restarts while host b's agent
    runs a turn: a's recovery leaves b's session alone. b's backend is SIGKILLed mid-turn: a shows b
    unreachable within cluster.host_timeout_s, b's session with its last known state marked so and
    never live, and nothing on a adopts it; b restarted re-tracks its own agent, the turn completes
    with every chunk once and in order, and a sees it."""
    url = postgres.new_database()
    a = kandev_factory("a", _config(url, "a"))
    b = kandev_factory("b", _config(url, "b"))
    a.up()
    st_b = b.up()
    _, own = a.start_session("on a")
    task, sid = b.start_session("on b")
    b.cli("prompt", sid, "/slow 40")
    first = wait_until(lambda: s if agent_chunks(s := b.show(sid)) else None, timeout=30)
    agent = first["agent_pid"]

    # both boards show both sessions with their hosts; a sees b's agent live
    row = _session_row(a, sid)
    assert (row["host"], row["host_state"]) == ("b", "ready")
    assert _session_row(a, own)["host"] == "a"
    table = a.human("session", "list").stdout
    assert table.splitlines()[0].split()[:4] == ["SESSION", "TASK", "TITLE", "HOST"], table
    board = {t["task_id"]: t for t in a.cli("task", "list")["tasks"]}
    assert board[task]["latest_session"]["host"] == "b" and board[task]["latest_session"]["live"] is True

    # a restarts (SIGKILL): its recovery touches only its own sessions
    os.kill(a.backend_pid, signal.SIGKILL)
    st_a = a.up()
    assert (st_a["recovery"]["retracked"], st_a["recovery"]["not_retracked"]) == (1, 0), st_a["recovery"]
    assert b.show(sid)["state"] == "RUNNING" and b.show(sid)["retracked"] is False and alive(agent)

    # b's backend is SIGKILLed mid-turn: a shows b unreachable, its session never live
    os.kill(st_b["backend"]["pid"], signal.SIGKILL)
    wait_until(lambda: not alive(st_b["backend"]["pid"]), timeout=10)
    seen = wait_until(lambda: h if (h := _hosts(a)["b"])["state"] == "unreachable" else None,
                      timeout=HOST_TIMEOUT_S + HEARTBEAT_S + 5)
    assert seen["since"] and seen["machine"] == os.uname().nodename
    row = _session_row(a, sid)
    assert (row["host"], row["host_state"], row["state"]) == ("b", "unreachable", "RUNNING")
    shown = a.cli("task", "show", task)["latest_session"]
    assert shown["live"] is False and shown["host_state"] == "unreachable"
    assert "RUNNING (host b unreachable)" in a.human("session", "list").stdout
    assert "RUNNING (host b unreachable)" in a.human("board").stdout
    show = a.cli("session", "show", sid)
    assert show["live"] is False and show["host_state"] == "unreachable"
    assert any(h["name"] == "b" for h in a.cli("status")["cluster"]["unreachable"])
    assert alive(agent)  # nothing adopted it: its own control server still runs it
    proc = a.run("cancel", sid)  # a has no way to its agent: refused at once, naming the host and since when
    assert proc.returncode == 1 and "host_unreachable" in proc.stdout and f"since {seen['since']}" in proc.stdout, \
        proc.stdout

    # b comes back: its own backend re-tracks its agent; the turn completes, seen from a
    st_b2 = b.up()
    assert st_b2["recovery"]["retracked"] == 1 and st_b2["adoption"]["outcome"] == "adopted", st_b2["recovery"]
    assert b.show(sid)["retracked"] is True
    wait_until(lambda: _hosts(a)["b"]["state"] == "ready", timeout=HOST_TIMEOUT_S + 10)
    done = wait_until(lambda: s if (s := a.cli("session", "show", sid))["state"] == "WAITING_FOR_INPUT" else None,
                      timeout=90)
    assert agent_chunks(done) == [f"{i}/40 " for i in range(1, 41)]
    assert done["host_state"] == "ready" and done["live"] is True
    hosts = _hosts(a)
    assert (hosts["b"]["sessions"], hosts["b"]["agents"], hosts["a"]["sessions"]) == (1, 1, 1)
    proc = a.run("task", "delete", task)  # its directories are on b: deleted from there
    assert proc.returncode == 1 and "belongs to cluster host b" in proc.stdout, proc.stdout


def _secret(path: Path, text: str) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    return str(path)


def test_the_database_password_comes_from_a_file_and_is_never_shown(kandev_factory, postgres, short_tmp):
    """Issue 47 item 6: a role that must give its password connects with database.password_file
    (the URL holds none); a wrong password is refused at start with the server's reason, and the
    password is in no log, no status and no refusal."""
    role, password = f"kd_pw_{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    postgres.password_role(role, password)
    url = postgres.new_database(owner=role)
    good = _secret(short_tmp / "db-password", password + "\n")
    k = kandev_factory("pw", _config(url, "p", survival=False, password_file=good))
    st = k.up()
    assert st["cluster"]["ready"] == ["p"] and st["store"]["unreachable"] is None, st["store"]
    task, sid = k.start_session("with a password")
    k.cli("prompt", sid, "hello", "--wait")
    assert agent_chunks(k.show(sid)) == ["echo: hello"]
    shown = k.human("status").stdout + k.run("status").stdout + k.run("doctor").stdout
    logs = "".join(p.read_text(errors="replace") for p in (k.home / "logs").glob("*.log"))
    assert password not in shown and password not in logs

    wrong = _secret(short_tmp / "wrong-password", "not-" + password)
    bad = kandev_factory("bad", _config(url, "q", survival=False, password_file=wrong))
    proc = _backend(bad)
    assert proc.returncode == 1 and "password authentication failed" in proc.stderr, proc.stderr
    assert password not in proc.stderr
    none = kandev_factory("none", _config(url, "r", survival=False))
    proc = _backend(none)
    assert proc.returncode == 1 and "password" in proc.stderr, proc.stderr


def test_status_says_the_database_is_unreachable_and_the_host_returns_when_it_is_back(kandev_factory, postgres):
    """Issue 47 item 5: with the PostgreSQL server stopped, `kandev status` answers and says the
    store is unreachable (a status line, not a crash), `kandev hosts` fails with the retryable
    store_unreachable; once the server is back the backend reconnects by itself: the store is
    reachable again and the host's heartbeat resumes."""
    url = postgres.new_database()
    a = kandev_factory("a", _config(url, "a", survival=False))
    pid = a.up()["backend"]["pid"]
    postgres.stop_server()
    try:
        st = a.cli("status")
        assert st["store"]["unreachable"] and "error" in st["cluster"], (st["store"], st["cluster"])
        assert "store unreachable since" in a.human("status").stdout
        proc = a.run("hosts")
        assert proc.returncode == 1 and "store_unreachable" in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)
    finally:
        postgres.start_server()
    wait_until(lambda: a.cli("status")["store"]["unreachable"] is None, timeout=30)
    before = a.cli("status")["cluster"]["last_heartbeat"]
    wait_until(lambda: (h := _hosts(a)["a"])["state"] == "ready" and h["last_heartbeat"] > before,
               timeout=HOST_TIMEOUT_S + 10)
    assert a.cli("status")["backend"]["pid"] == pid
