"""Issue 46 item 5 (Issue 46 Why 5): a running turn whose agent says nothing is shown as such, and
can be timed out.

``QuietTurns`` on a clock the test moves (no sleeping): when a turn counts as quiet, the real number
of seconds, what ends a silence (any event of the turn; a permission request hands the word to the
user), the timeout reported once; the ``quiet`` object's hint (the provider address without any
secret in it); the two settings' ranges; the store keeping a timed-out turn's ``cancelled`` as
``timeout`` (its transcript saying so) and the board's reason; and one look of the turn watch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from daemon.agents.settings import AgentSettings
from daemon.backend.sessions.turn_watch import TurnWatch
from daemon.backend.state.events import apply_events, mark_timed_out
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.state.quiet_turns import QuietTurns, note_events
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.quiet_report import provider_address, quiet_report
from daemon.config.keys import ConfigError
from daemon.config.settings import load_config, validate_backend
from daemon.store import transcript
from daemon.store.board import attention_hint, placement
from daemon.store.db import Store
from daemon.store.models import TaskSession, Turn
from daemon.store.states import Attention, SessionState, TaskState, TurnState
from daemon.store.transcript import ensure_turn
from ipc.client import Event
from tests.support.aio import run
from tests.support.store_rows import new_session


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_turn_is_quiet_from_the_warning_on_with_the_real_number_of_seconds(clock: Clock) -> None:
    """Issue 46 Why 5: nothing before agents.quiet_warning_s; then the seconds as they are (45, not 30)."""
    quiet = QuietTurns(clock, warning_s=30)
    quiet.started("s1", "t1")
    clock.advance(29.9)
    assert quiet.quiet("s1") is None
    assert quiet.crossed() == []
    clock.advance(0.1)
    q = quiet.quiet("s1")
    assert q is not None and (q.turn_id, q.seconds, q.level, q.timed_out) == ("t1", 30, 1, False)
    clock.advance(15)
    q = quiet.quiet("s1")
    assert q is not None and q.seconds == 45
    assert quiet.quiet("other") is None


def test_each_multiple_of_the_warning_is_reported_once_and_output_starts_a_new_silence(clock: Clock) -> None:
    """Issue 46 Why 5: ``crossed`` wakes the follow streams once per level; anything the agent sends
    for the turn (here a tool call) ends the silence, and the next one is a new period."""
    quiet = QuietTurns(clock, warning_s=10)
    quiet.started("s1", "t1")
    clock.advance(10)
    first = quiet.crossed()
    assert [(q.session_id, q.level) for q in first] == [("s1", 1)]
    assert quiet.crossed() == []  # reported once
    clock.advance(10)
    assert [q.level for q in quiet.crossed()] == [2]
    note_events(quiet, "s1", [Event(5, "session_update", {"turn_id": "t1", "update": {"sessionUpdate": "tool_call"}})])
    assert quiet.quiet("s1") is None
    clock.advance(10)
    # what the agent says outside any turn (a line that is not JSON-RPC) is heard too
    note_events(quiet, "s1", [Event(6, "agent_error", {"message": "not JSON-RPC: connecting..."})])
    assert quiet.quiet("s1") is None
    clock.advance(10)
    again = quiet.crossed()
    assert [q.level for q in again] == [1] and again[0].period != first[0].period


def test_an_open_permission_request_waits_for_the_user_not_the_agent(clock: Clock) -> None:
    """Issue 46 Why 5: while the agent waits for its user's answer the turn is not quiet and is not
    timed out; the answer gives the agent the word again, its silence counted from then."""
    quiet = QuietTurns(clock, warning_s=5, timeout_s=10)
    note_events(quiet, "s1", [Event(1, "turn_started", {"turn_id": "t1", "text": "/permission"}),
                              Event(2, "permission_request", {"turn_id": "t1", "request_id": "r1"})])
    clock.advance(60)
    assert quiet.quiet("s1") is None and quiet.due() == [] and quiet.next_change() is None
    quiet.answered("s1", "r1")
    clock.advance(5)
    assert quiet.quiet("s1") is not None and quiet.quiet("s1").seconds == 5  # type: ignore[union-attr]
    note_events(quiet, "s1", [Event(3, "permission_request", {"turn_id": "t1", "request_id": "r2"}),
                              Event(4, "permission_cancelled", {"turn_id": "t1", "request_id": "r2"})])
    assert quiet.quiet("s1") is None  # the cancel gave the word back: a new silence from now


def test_the_timeout_is_reported_once_and_never_when_off(clock: Clock) -> None:
    """Issue 46 Why 5: agents.turn_timeout_s = 0 never ends a turn; otherwise ``due`` names the turn once."""
    off = QuietTurns(clock, warning_s=1, timeout_s=0)
    on = QuietTurns(clock, warning_s=1, timeout_s=20)
    for quiet in (off, on):
        quiet.started("s1", "t1")
    clock.advance(19)
    assert on.due() == []
    assert on.next_change() == pytest.approx(1.0)
    clock.advance(1)
    due = on.due()
    assert [(q.session_id, q.turn_id, q.seconds, q.timed_out) for q in due] == [("s1", "t1", 20, True)]
    assert on.due() == []
    q = on.quiet("s1")
    assert q is not None and q.timed_out
    clock.advance(1000)
    assert off.due() == []


def test_a_turn_that_ended_or_whose_agent_exited_is_forgotten(clock: Clock) -> None:
    """Issue 46 Why 5: only an open turn can be quiet."""
    quiet = QuietTurns(clock, warning_s=1)
    note_events(quiet, "s1", [Event(1, "turn_started", {"turn_id": "t1", "text": "hi"}),
                              Event(2, "turn_ended", {"turn_id": "t1", "stop_reason": "end_turn"})])
    note_events(quiet, "s2", [Event(1, "turn_started", {"turn_id": "t2", "text": "hi"}),
                              Event(2, "agent_exited", {"exit_code": 1})])
    clock.advance(100)
    assert quiet.all_quiet() == {}
    quiet.started("s3", "t3")
    quiet.ended("s3", "another turn")  # not its open turn: nothing changes
    clock.advance(1)
    assert set(quiet.all_quiet()) == {"s3"}


def test_the_quiet_object_names_the_log_the_cancel_and_the_provider_without_secrets(clock: Clock) -> None:
    """Issue 46 Why 5: the hint carries the commands and the provider address the agent was given,
    never a user, password or query the address holds."""
    quiet = QuietTurns(clock, warning_s=30)
    quiet.started("0123456789abcdef", "t1")
    clock.advance(45)
    settings = {"claude-code": AgentSettings("claude-code", env={
        "ANTHROPIC_MODEL": "m", "ANTHROPIC_BASE_URL": "https://user:sk-secret@llm.example:8443/v1?key=sk-2#x"})}
    report = quiet_report(quiet.quiet("0123456789abcdef"), "0123456789abcdef", "claude-code", settings)
    assert report == {"turn_id": "t1", "seconds": 45, "timed_out": False, "logs": "kandev logs 01234567",
                      "cancel": "kandev cancel 01234567",
                      "provider": "ANTHROPIC_BASE_URL=https://llm.example:8443/v1"}
    assert provider_address(AgentSettings("mock", env={"MOCK_MODE": "x"})) is None
    assert provider_address(None) is None
    assert provider_address(AgentSettings("codex", env={"OPENAI_BASE_URL": "http://[::1]:9/v1"})) == (
        "OPENAI_BASE_URL=http://[::1]:9/v1")
    assert quiet_report(None, "s", "mock", settings) is None


@pytest.mark.parametrize(("key", "value", "accepted"), [
    ("quiet_warning_s", "0", "1..3600"), ("quiet_warning_s", "3601", "1..3600"),
    ("turn_timeout_s", "-1", "0..604800"), ("turn_timeout_s", "604801", "0..604800"),
])
def test_out_of_range_settings_are_refused_naming_key_value_and_range(
        tmp_path: Path, key: str, value: str, accepted: str) -> None:
    """Issue 46 Why 5: a bad agents.quiet_warning_s / agents.turn_timeout_s is a clear refusal."""
    path = tmp_path / "kandev.toml"
    path.write_text(f"[agents]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as refused:
        validate_backend(load_config(str(path), env={}))
    message = str(refused.value)
    assert f"agents.{key}" in message and value in message and accepted in message, message


def test_the_defaults_warn_after_30_s_and_never_time_out(tmp_path: Path) -> None:
    """Issue 46 Why 5: agents.quiet_warning_s defaults to 30, agents.turn_timeout_s to off."""
    config = load_config(None, env={})
    validate_backend(config)
    assert (config.agents.quiet_warning_s, config.agents.turn_timeout_s) == (30, 0)


def _running_turn(store: Store, turn_id: str) -> str:
    session_id = new_session(store, SessionState.RUNNING)
    with store.session() as db:
        ensure_turn(db, session_id, turn_id, "/silent 600")
    return session_id


def _end(store: Store, session_id: str, turn_id: str, stop_reason: str) -> list[tuple[str, str | None]]:
    with store.session() as db:
        return apply_events(db, session_id, "i1", [
            Event(1, "turn_ended", {"turn_id": turn_id, "stop_reason": stop_reason, "error": None})]).ended_turns


def test_a_timed_out_turn_cancelled_by_its_agent_ends_with_reason_timeout(store: Store) -> None:
    """Issue 46 Why 5: the transcript says timeout, the turn's stop reason is ``timeout`` (what a
    waiting ``prompt --wait`` gets too), the session waits for input with the reason as last error."""
    session_id = _running_turn(store, "t1")
    with store.session() as db:
        assert mark_timed_out(db, session_id, "t1", seconds=61, limit=60)
    assert _end(store, session_id, "t1", "cancelled") == [("t1", "timeout")]
    with store.session() as db:
        turn = db.get(Turn, "t1")
        assert turn is not None and (turn.state, turn.stop_reason) == (TurnState.FINISHED, "timeout")
        assert turn.error is not None and "no output from the agent for 61 s" in turn.error
        session = db.get(TaskSession, session_id)
        assert session is not None and session.state == SessionState.WAITING_FOR_INPUT
        assert session.last_error == turn.error
        kinds = [(c.kind, c.text) for c in transcript.chunks_after(db, session_id, 0)]
    assert ("turn_timeout", f"{turn.error}; cancelling the turn") in kinds


def test_a_timed_out_turn_that_finishes_anyway_keeps_its_own_end(store: Store) -> None:
    """Issue 46 Why 5: the agent answered before the cancel reached it: its end_turn stands. A turn
    already over is not marked."""
    session_id = _running_turn(store, "t1")
    with store.session() as db:
        assert mark_timed_out(db, session_id, "t1", seconds=61, limit=60)
    assert _end(store, session_id, "t1", "end_turn") == [("t1", "end_turn")]
    with store.session() as db:
        turn = db.get(Turn, "t1")
        assert turn is not None and (turn.stop_reason, turn.error) == ("end_turn", None)
        assert not mark_timed_out(db, session_id, "t1", seconds=99, limit=60)


def test_the_board_says_timeout() -> None:
    """Issue 46 Why 5: a task whose last turn timed out needs its user, for reason ``timeout``."""
    assert placement(TaskState.REVIEW, SessionState.WAITING_FOR_INPUT, live=True, last_stop_reason="timeout") == (
        "needs_attention", Attention.TIMEOUT)
    assert "agents.turn_timeout_s" in (attention_hint(Attention.TIMEOUT, "mock", None) or "")


@dataclass
class _Tracked:
    session_id: str


def test_one_look_of_the_turn_watch_wakes_followers_then_cancels_once(store: Store, clock: Clock) -> None:
    """Issue 46 Why 5: the turn watch wakes the session's follow streams when its turn grows quiet,
    and at agents.turn_timeout_s marks the turn and cancels it through the cancel path, once."""
    session_id = _running_turn(store, "t1")
    quiet = QuietTurns(clock, warning_s=2, timeout_s=5)
    executions = ExecutionStore()
    executions.executions[session_id] = _Tracked(session_id)  # type: ignore[assignment]
    hub = TranscriptHub()
    woken: list[str] = []
    hub.notify = lambda ids: woken.extend(ids)  # type: ignore[method-assign]
    cancelled: list[str] = []

    async def cancel(sid: str) -> Any:
        cancelled.append(sid)
        return {"ok": True}

    watch = TurnWatch(quiet, executions, store, hub, cancel, timeout_s=5)
    quiet.started(session_id, "t1")
    quiet.started("untracked", "t9")

    async def look(seconds: float) -> None:
        clock.advance(seconds)
        await watch.tick()

    run(look(1))
    assert (woken, cancelled) == ([], [])
    run(look(1))
    assert (woken, cancelled) == ([session_id], [])  # the untracked session is forgotten, not woken
    assert quiet.quiet("untracked") is None
    run(look(3))
    assert cancelled == [session_id]
    run(look(10))
    assert cancelled == [session_id]  # once
    with store.session() as db:
        turn = db.scalars(select(Turn).where(Turn.id == "t1")).one()
        assert (turn.state, turn.stop_reason) == (TurnState.OPEN, "timeout")  # until its agent answers


def test_the_turn_watch_is_woken_only_when_a_silence_may_end_sooner(clock: Clock) -> None:
    """Issue 46 Why 5: the watch sleeps until the next level or timeout; a new turn or an answered
    permission request wakes it (their deadlines may come sooner), the agent's output does not."""
    quiet = QuietTurns(clock, warning_s=30)
    woken: list[int] = []
    quiet.on_sooner = lambda: woken.append(1)
    quiet.started("s1", "t1")
    quiet.started("s1", "t1")  # the same turn again
    assert len(woken) == 1
    quiet.output("s1", "t1")
    quiet.asked("s1", "t1", "r1")
    assert len(woken) == 1
    quiet.answered("s1", "r1")
    assert len(woken) == 2
    clock.advance(12)
    assert quiet.next_change() == pytest.approx(18.0)
