"""Stop means stop (Issue 45 item 5; Issue 45 scenario E), through the real daemons and the mock agent's
``/sh`` in its sandbox.

- ``kandev cancel`` of a ``/sh`` turn leaves no process of that turn: not the command's own
  (``sleep 300 & sleep 300``), not one it put in the background that outlives the shell (an orphan
  re-parented to the sandbox's init), not one that left the command's process group and session
  (``setsid``), which only the control server can still find; a background process an earlier turn
  started is not the cancelled turn's and keeps running;
- ``kandev session stop`` of a RUNNING session succeeds at once: the turn ends ``stopped``, the
  transcript says so, the agent's process group and every process of its turn are gone (with
  ``agents.sandbox = "off"`` too, where a tool that left the agent's group is no longer ended by a
  pid namespace), and ``kandev resume`` gives the session an agent again.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest

from tests.support.kandev import Kandev
from tests.support.processes import group_exists
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

SLEEP = ["sleep", "300"]
EARLIER = ["sleep", "301"]  # started by an earlier turn, in the background


def _sandbox(leader: int) -> list[list[str]]:
    """The command lines of every live process below the agent's bwrap (the whole sandbox)."""
    try:
        below = psutil.Process(leader).children(recursive=True)
    except psutil.Error:
        return []
    lines = []
    for p in below:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                lines.append(p.cmdline())
        except psutil.Error:
            continue
    return lines


def _session(k: Kandev) -> tuple[str, int]:
    k.up()
    _task, sid = k.start_session("stop means stop")
    wait_until(lambda: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=60)
    return sid, int(k.show(sid)["agent_pid"])


def _turn_running(k: Kandev, sid: str, leader: int, command: str, sleepers: int) -> None:
    k.cli("prompt", sid, "/sh " + command)
    wait_until(lambda: _sandbox(leader).count(SLEEP) == sleepers, timeout=60,
               message=f"{sleepers} x {' '.join(SLEEP)} running in the sandbox")
    assert k.show(sid)["state"] == "RUNNING"


@pytest.mark.parametrize("command", [
    "sleep 300 & sleep 300",  # the scenario's words
    "(sleep 300 &); sleep 300",  # an orphan of the command's group, re-parented to the sandbox's init
    "setsid sh -c 'sleep 300 & :'; sleep 300",  # an orphan in a session of its own: the control server's to end
])
def test_scenario_e_cancel_leaves_no_process_of_the_turn(kandev_factory: Any, command: str) -> None:
    """Issue 45 scenario E (cancel): once the cancelled turn has ended, no process it started is
    left in the sandbox, while a background process of an earlier turn keeps running."""
    k = kandev_factory()
    sid, leader = _session(k)
    k.cli("prompt", sid, "/sh setsid sleep 301 >/dev/null 2>&1 &", "--wait")
    assert EARLIER in _sandbox(leader)
    _turn_running(k, sid, leader, command, 2)

    assert k.cli("cancel", sid) == {"ok": True}
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=30)
    assert done["turns"][-1]["stop_reason"] == "cancelled"
    wait_until(lambda: SLEEP not in _sandbox(leader) and ["sh", "-c", command] not in _sandbox(leader),
               timeout=10, message="no process of the cancelled turn is left")
    assert EARLIER in _sandbox(leader)  # not the cancelled turn's
    assert k.show(sid)["live"]
    k.cli("prompt", sid, "still here", "--wait")


@pytest.mark.parametrize("sandbox", ["required", "off"])
def test_scenario_e_session_stop_of_a_running_session_stops_it_at_once(kandev_factory: Any, sandbox: str) -> None:
    """Issue 45 scenario E (session stop): a RUNNING session is stopped at once (no refusal, no
    --force): the turn ends ``stopped`` and the transcript says so, the agent's group and every
    process of its turn are gone (unsandboxed too, where no pid namespace ends them); resume gives
    the session an agent again."""
    k = kandev_factory(config_text=f'[agents]\nsandbox = "{sandbox}"\n')
    sid, leader = _session(k)
    _turn_running(k, sid, leader, "setsid sleep 300 & sleep 300", 2)
    sleepers = [p for p in psutil.Process(leader).children(recursive=True) if p.cmdline() == SLEEP]

    p = k.human("session", "stop", sid)
    assert p.returncode == 0 and p.stderr == "", p
    turn = k.show(sid)["turns"][-1]
    assert p.stdout.startswith(f"Stopped the agent of session {sid[:8]}") and turn["turn_id"] in p.stdout, p.stdout
    wait_until(lambda: not group_exists(leader), timeout=30, message="the agent's process group is gone")
    wait_until(lambda: not any(_running(s) for s in sleepers), timeout=10, message="no process of the turn is left")
    show = k.show(sid)
    assert show["state"] == "WAITING_FOR_INPUT" and not show["live"]
    assert (turn["state"], turn["stop_reason"]) == ("finished", "stopped")
    said = [e for e in k.transcript(sid) if e["kind"] == "session_stopped"]
    assert len(said) == 1 and "stopped" in said[0]["text"] and said[0]["turn_id"] == turn["turn_id"], said
    human = k.human("session", "show", sid).stdout
    assert "[turn stopped]" in human, human

    k.cli("resume", sid, timeout=180)
    assert k.cli("prompt", sid, "after the stop", "--wait")["stop_reason"] == "end_turn"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
