"""Following a session of another host from the shared store (Issue 47 item 3), through faults.

Two kandev homes on this machine are the hosts ``a`` and ``b`` of one database; ``a``'s CLI follows a
session of ``b``: ``a``'s backend streams it from the shared store, woken by ``b``'s NOTIFYs.

- Issue 47 scenario C: ``b``'s agent floods (``/flood 20000``) and PostgreSQL is restarted in the
  middle (down for two seconds): ``a``'s follow goes on, every chunk once and in order, then the end.
- Issue 47 scenario B, the turn ending while ``b``'s backend is away: ``b``'s recovery stores the
  turn's outcome before it replays the turn's last events; ``a``'s follow still shows each of them
  before the end (``Turn.replaying``).
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest

from tests.support.kandev import Kandev
from tests.support.processes import alive
from tests.support.streams import TimedOutput, sequence_problem
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

N = 20000


def _hosts(kandev_factory: Any, postgres: Any) -> tuple[Kandev, Kandev]:
    url = postgres.new_database()
    made = []
    for host in ("a", "b"):
        k = kandev_factory(host, f'[database]\nurl = "{url}"\n[cluster]\nhost = "{host}"\nheartbeat_s = 1\n'
                                 "host_timeout_s = 10\n[features]\nagent_survival = true\n")
        k.up()
        made.append(k)
    return made[0], made[1]


def _started_on_b(a: Kandev, b: Kandev, title: str) -> str:
    """A task created from ``a`` and a session on ``b`` for it, waiting for input (its agent b's)."""
    task = a.cli("task", "create", "--title", title)["task_id"]
    sid: str = a.cli("session", "start", task, "--host", "b")["session_id"]
    show = wait_until(lambda: s if (s := a.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)
    b.agent_pids.add(int(show["agent_pid"]))
    return sid


def test_a_follows_a_flood_on_b_through_a_postgresql_restart(kandev_factory, postgres):
    """Issue 47 scenario C (following from another host): ``/flood 20000`` on ``b`` followed from
    ``a``; PostgreSQL restarted mid-flood: nothing lost or duplicated in ``a``'s follow."""
    a, b = _hosts(kandev_factory, postgres)
    sid = _started_on_b(a, b, "flood on b")
    a.cli("prompt", sid, f"/flood {N}")
    follow = a.popen("follow", sid[:8], "--reconnect-timeout", "120")
    out, err = TimedOutput(follow.stdout), TimedOutput(follow.stderr)
    out.wait_for(f"1000/{N} ", timeout=120)
    assert f"{N}/{N} " not in out.text  # the flood goes on while the database restarts
    postgres.restart(stopped_for=2.0)
    assert follow.wait(timeout=400) == 0, err.text
    seen = re.findall(rf"(\d+)/{N} ", out.text)
    stored = [e["text"] for e in b.transcript(sid) if e["kind"] == "agent_message_chunk"]
    assert sequence_problem(stored, [f"{i}/{N} " for i in range(1, N + 1)]) is None  # b stored each once
    problem = sequence_problem(seen, [str(i) for i in range(1, N + 1)])
    assert problem is None, (problem, err.text[-2000:])
    assert out.text.rstrip().endswith("[turn ended: end_turn]")


def test_a_follows_a_turn_that_ended_while_b_was_away(kandev_factory, postgres):
    """Issue 47 scenario B (the turn ends while ``b``'s backend is SIGKILLed): ``a``'s follow, open
    throughout, shows every chunk once and in order, then the turn's end, after ``b`` restarts."""
    a, b = _hosts(kandev_factory, postgres)
    sid = _started_on_b(a, b, "ends while b is away")
    a.cli("prompt", sid, "/slow 6")
    follow = a.popen("follow", sid[:8], "--reconnect-timeout", "120")
    out, err = TimedOutput(follow.stdout), TimedOutput(follow.stderr)
    out.wait_for("2/6 ", timeout=60)
    backend = b.backend_pid
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    history = b.home / "sessions" / sid / "agent" / "mock-sessions"
    wait_until(lambda: any("6/6 " in p.read_text() for p in history.glob("*.history.jsonl")), timeout=60,
               message="the agent said its last chunk (its turn ends with it) while b's backend is away")
    assert "6/6 " not in out.text
    b.up()
    assert follow.wait(timeout=120) == 0, err.text
    assert re.findall(r"\d+/6 ", out.text) == [f"{i}/6 " for i in range(1, 7)], out.text
    assert out.text.rstrip().endswith("[turn ended: end_turn]")
