"""The human views of a cluster (Issue 47 item 3, Issue 47 item 4): a HOST column in the lists only
when sessions have hosts, a session of a host that is not ready shown with its last known state
marked so (never NO AGENT, never live), `kandev hosts` and the cluster's part of `kandev status`."""

from __future__ import annotations

from typing import Any

from daemon.cli.human.status import render_status
from daemon.cli.human.term import Term
from daemon.cli.human.views import board_lines, hosts_lines, session_list_lines, task_list_lines

SINCE = "2026-12-06T23:55:25.893421+00:00"


def _session(sid: str, host: str | None, host_state: str | None, *, live: bool) -> dict[str, Any]:
    s: dict[str, Any] = {"session_id": sid, "task_id": "t" + sid, "task_title": f"work {sid}", "agent": "mock",
                         "state": "RUNNING", "live": live, "retracked": False, "created_at": None, "last_turn": None}
    if host is not None:
        s.update(host=host, host_state=host_state)
    return s


def test_the_host_column_and_an_unreachable_hosts_session() -> None:
    term = Term(width=160)
    rows = [_session("aaaaaaaa1", "a", "ready", live=True), _session("bbbbbbbb1", "b", "unreachable", live=False)]
    lines = session_list_lines({"sessions": rows}, term, show_all=False)
    assert lines[0].split()[:5] == ["SESSION", "TASK", "TITLE", "HOST", "AGENT"]
    b_line = next(line for line in lines if line.startswith("bbbbbbbb"))
    assert "RUNNING (host b unreachable)" in b_line and "NO AGENT" not in b_line
    single = session_list_lines({"sessions": [_session("cccccccc1", None, None, live=True)]}, term, show_all=False)
    assert "HOST" not in single[0]  # a single host's table is as it was

    tasks = [{"task_id": "t" + s["session_id"], "title": s["task_title"], "bucket": "running", "sessions": 1,
              "latest_session": s, "attention": None, "created_at": None, "workflow": None} for s in rows]
    board = board_lines({"tasks": tasks}, term)
    assert any("RUNNING (host b unreachable)" in line for line in board)
    listed = task_list_lines({"tasks": tasks}, term)
    assert "HOST" in listed[0].split() and any("RUNNING (host b unreachable)" in line for line in listed)


def test_hosts_and_status() -> None:
    term = Term(width=160)
    hosts = {"host": "a", "hosts": [
        {"name": "a", "state": "ready", "since": None, "version": "0.3.0", "sessions": 2, "agents": 1, "own": True,
         "last_heartbeat": SINCE},
        {"name": "b", "state": "unreachable", "since": SINCE, "version": "0.3.0", "sessions": 1, "agents": 1,
         "own": False, "last_heartbeat": SINCE}]}
    lines = hosts_lines(hosts, term)
    assert lines[0].split() == ["HOST", "STATE", "VERSION", "SESSIONS", "AGENTS", "LAST", "HEARTBEAT"]
    assert lines[1].startswith("a *") and "unreachable since 2026-12-06 23:55:25Z" in lines[2]
    assert "single host" in hosts_lines({"host": None, "hosts": []}, term)[0]

    status = {"backend": {"state": "ready", "pid": 1, "version": "0.3.0"},
              "store": {"reachable": False, "unreachable_since": 1765065325.0,
                        "unreachable": {"since": 1765065325.0, "seconds": 12.0, "attempts": 3,
                                        "detail": "OperationalError: connection refused"}},
              "cluster": {"host": "a", "heartbeat_s": 5, "host_timeout_s": 30, "ready": ["a"],
                          "unreachable": [{"name": "b", "since": SINCE}], "stopped": ["c"]}}
    text = "\n".join(render_status(status, term))
    assert "store unreachable since" in text and "(OperationalError: connection refused)" in text
    assert "cluster host b is unreachable since 2026-12-06 23:55:25Z" in text
    assert "hosts: 1 ready (a), 1 unreachable (b), 1 stopped (c)" in text and "host a (a heartbeat every 5 s" in text
