"""Issue 46 item 5 (Issue 46 Why 5): a real agent that never answers is no longer a silent hang.

Through the real CLI against real daemons, with the mock agent's ``/silent N`` (it says nothing for
N seconds, as an agent whose provider does not answer) and small settings:

- with ``agents.quiet_warning_s = 1``, ``kandev prompt --follow`` says ``waiting for the agent: no
  output for N s`` (N growing with the silence) with the hint (``kandev logs SID``, the provider
  address the agent was given in ``[agents.mock] env``, ``kandev cancel SID``), and so do
  ``kandev board``, ``task list --json`` and ``session show``; the warning goes once the turn ends;
- with ``agents.turn_timeout_s = 3``, the silent turn is cancelled and ends with reason ``timeout``:
  in the follow, the transcript, the turn and the board; the session takes the next prompt;
- a silent turn whose agent survives a SIGKILLed backend is shown and timed out by the next one;
- an agent that ignores the cancel of its timed-out turn (``/hang N``, a wedged agent) is stopped
  ``turn_timeout_s`` later, its whole process group with it, the turn ended ``timeout``;
- an out-of-range value is refused by ``kandev up``.

Before the fix the follow printed nothing, the board said RUNNING, and nothing ever ended the turn.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.kandev import Kandev
from tests.support.processes import alive, group_exists
from tests.support.streams import TimedOutput
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

PROVIDER = "MOCK_BASE_URL=http://127.0.0.1:9/v1"
CONFIG = '[agents.mock]\nenv = {{ MOCK_BASE_URL = "http://127.0.0.1:9/v1" }}\n\n[agents]\nquiet_warning_s = 1\n{extra}'


def _home(kandev_factory: Callable[..., Kandev], extra: str = "") -> Kandev:
    k = kandev_factory(config_text=CONFIG.format(extra=extra))
    k.up()
    return k


def _session(k: Kandev) -> tuple[str, str]:
    task, sid = k.start_session("silent provider")
    wait_until(lambda: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=60)
    return task, sid


def _task_row(k: Kandev, task: str) -> dict[str, Any]:
    return next(t for t in k.cli("task", "list")["tasks"] if t["task_id"] == task)


def _quiet_seconds(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"waiting for the agent: no output for (\d+) s", text)]


def test_a_silent_turn_is_shown_as_waiting_for_the_agent_in_follow_and_on_the_board(
        kandev_factory: Callable[..., Kandev]) -> None:
    """Issue 46 Why 5 (Build 5): the warning with the real number of seconds and the hint, in
    ``prompt --follow``, ``board``, ``task list --json`` and ``session show``; gone once the turn ends."""
    k = _home(kandev_factory)
    task, sid = _session(k)
    follow = k.popen("prompt", sid, "/silent 600", "--follow")
    err = TimedOutput(follow.stderr)
    out = TimedOutput(follow.stdout)
    first = wait_until(lambda: _quiet_seconds(err.text), timeout=60, message="follow says the agent is silent")[0]
    assert first >= 1
    # the silence goes on and the number grows with it: the real seconds, not the setting
    wait_until(lambda: max(_quiet_seconds(err.text)) > first, timeout=60, message="follow says the silence grew")
    hint = next(line for line in err.text.splitlines() if line.startswith("hint:"))
    assert f"kandev logs {sid[:8]}" in hint and PROVIDER in hint and f"kandev cancel {sid[:8]}" in hint, hint

    quiet = wait_until(lambda: (_task_row(k, task)["latest_session"] or {}).get("quiet"), timeout=30)
    assert quiet["seconds"] >= 1 and quiet["turn_id"] and quiet["provider"] == PROVIDER
    assert not quiet["timed_out"]  # agents.turn_timeout_s is off by default

    board = k.human("board")
    assert board.returncode == 0, board.stderr
    assert _quiet_seconds(board.stdout) and min(_quiet_seconds(board.stdout)) >= 1, board.stdout
    assert f"kandev logs {sid[:8]}" in board.stdout and PROVIDER in board.stdout, board.stdout
    shown = k.human("session", "show", sid)
    assert _quiet_seconds(shown.stdout) and f"kandev cancel {sid[:8]}" in shown.stdout, shown.stdout
    assert k.cli("session", "show", sid)["quiet"]["seconds"] >= 1

    assert k.run("cancel", sid).returncode == 0
    assert follow.wait(timeout=60) == 1
    out.join()
    assert "[turn cancelled]" in out.text, out.text
    wait_until(lambda: _task_row(k, task)["latest_session"]["quiet"] is None, timeout=30,
               message="the board's warning goes once the turn ended")
    assert k.cli("session", "show", sid)["quiet"] is None


def test_a_turn_silent_for_turn_timeout_s_ends_with_reason_timeout(kandev_factory: Callable[..., Kandev]) -> None:
    """Issue 46 Why 5 (Build 5): agents.turn_timeout_s cancels the silent turn through the cancel
    path; follow, transcript, turn and board say ``timeout``; the session takes the next prompt."""
    k = _home(kandev_factory, "turn_timeout_s = 3\n")
    task, sid = _session(k)
    follow = k.popen("prompt", sid, "/silent 600", "--follow")
    out, err = TimedOutput(follow.stdout), TimedOutput(follow.stderr)
    assert follow.wait(timeout=120) == 1, err.text
    out.join()
    err.join()
    assert re.search(r"\[timeout: no output from the agent for \d+ s \(agents.turn_timeout_s = 3\)", out.text), out.text
    assert "[turn failed: timeout]" in out.text, out.text
    assert _quiet_seconds(err.text), err.text  # it was shown as waiting first

    show = k.cli("session", "show", sid)
    turn = show["turns"][-1]
    assert (turn["state"], turn["stop_reason"]) == ("finished", "timeout"), turn
    assert any(e["kind"] == "turn_timeout" for e in show["transcript"]), show["transcript"]
    assert show["state"] == "WAITING_FOR_INPUT" and show["quiet"] is None
    row = _task_row(k, task)
    assert row["bucket"] == "needs_attention" and row["attention"]["reason"] == "timeout", row
    board = k.human("board")
    assert "timeout" in board.stdout and "agents.turn_timeout_s" in board.stdout, board.stdout

    # the agent and the session are fine: the next prompt is answered
    assert k.cli("prompt", sid, "hello", "--wait")["stop_reason"] == "end_turn"


def test_an_agent_that_ignores_the_cancel_of_its_timed_out_turn_is_stopped(
        kandev_factory: Callable[..., Kandev]) -> None:
    """Issue 46 Why 5, Issue 45 item 5 (stop means stop): a wedged agent (``/hang``: silent, the
    cancel ignored) is not left holding its turn open forever: ``turn_timeout_s`` after the cancel
    its agent is stopped as ``session stop`` stops one (its process group gone), the turn ends with
    reason ``timeout``, the transcript and the journal say who stopped it; ``resume`` gives the
    session an agent again."""
    k = _home(kandev_factory, "turn_timeout_s = 2\n")
    task, sid = _session(k)
    agent = int(k.show(sid)["agent_pid"])
    group = os.getpgid(agent)
    k.cli("prompt", sid, "/hang 600")
    turn = wait_until(lambda: t if (t := k.cli("session", "show", sid)["turns"][-1])["state"] != "open" else None,
                      timeout=60, message="the wedged agent's turn never ended")
    assert (turn["state"], turn["stop_reason"]) == ("finished", "timeout"), turn
    wait_until(lambda: not group_exists(group), timeout=30, message="the wedged agent's process group lives on")
    show = k.cli("session", "show", sid)
    assert show["state"] == "WAITING_FOR_INPUT" and not show["live"], show
    stopped = [e["text"] for e in show["transcript"] if e["kind"] == "session_stopped"]
    assert stopped and "did not answer the cancel" in stopped[0] and "agents.turn_timeout_s = 2" in stopped[0], stopped
    log = (k.home / "logs" / "backend.log").read_text()
    assert " turn_cancel_unanswered " in log and " session_agent_stopped " in log, log[-2000:]
    assert _task_row(k, task)["attention"]["reason"] == "timeout"
    k.cli("resume", sid)
    assert k.cli("prompt", sid, "hello", "--wait")["stop_reason"] == "end_turn"


def test_a_silent_turn_re_tracked_after_a_backend_restart_is_still_shown_and_timed_out(
        kandev_factory: Callable[..., Kandev]) -> None:
    """Issue 46 Why 5: with survival on, a backend SIGKILLed during a silent turn re-tracks the
    agent; the new backend counts the turn's silence from its start, shows it and times it out."""
    k = kandev_factory(config_text=CONFIG.format(extra="turn_timeout_s = 6\n"),
                       KANDEV_FEATURES_AGENT_SURVIVAL="true")
    first = k.up()
    task, sid = _session(k)
    k.cli("prompt", sid, "/silent 600")
    wait_until(lambda: (_task_row(k, task)["latest_session"] or {}).get("quiet"), timeout=30)
    backend = first["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    assert k.up()["recovery"]["retracked"] == 1
    quiet = wait_until(lambda: (_task_row(k, task)["latest_session"] or {}).get("quiet"), timeout=30)
    assert quiet["provider"] == PROVIDER
    turn = wait_until(lambda: t if (t := k.cli("session", "show", sid)["turns"][-1])["state"] != "open" else None,
                      timeout=60)
    assert turn["stop_reason"] == "timeout", turn
    assert _task_row(k, task)["attention"]["reason"] == "timeout"


@pytest.mark.parametrize(("line", "accepted"), [("quiet_warning_s = 0", "1..3600"),
                                                ("turn_timeout_s = 604801", "0..604800")])
def test_an_out_of_range_setting_is_refused_by_up_naming_key_value_and_range(
        kandev_factory: Callable[..., Kandev], line: str, accepted: str) -> None:
    """Issue 46 Why 5: ``kandev up`` refuses the value before starting anything, and says why."""
    k = kandev_factory(config_text=f"[agents]\n{line}\n")
    proc = k.human("up")
    key, value = (part.strip() for part in line.split("="))
    assert proc.returncode != 0
    assert f"agents.{key}" in proc.stderr and value in proc.stderr and accepted in proc.stderr, proc.stderr
    assert not (k.home / "run" / "backend.sock").exists()
