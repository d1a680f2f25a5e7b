"""daemon.backend.views.lists: ``task_list`` (``kandev task list``, ``board``) places each task by its
latest session's last ended turn, reading every task's in a constant number of queries.

Each test runs on SQLite and on a real PostgreSQL server (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from daemon.backend.state.executions import ExecutionStore
from daemon.backend.views.lists import Views
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession, Turn

T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture
def store(any_store: Store) -> Store:
    return any_store


def _task(store: Store, title: str, turns: list[tuple[str, str | None]], session_state: str = "WAITING_FOR_INPUT",
          older_session_turns: list[tuple[str, str | None]] | None = None) -> str:
    """A task in review whose latest session has ``turns`` ((state, stop_reason), in order); an
    older session may have turns of its own."""
    with store.session() as db:
        task = Task(title=title, state="review")
        db.add(task)
        db.flush()
        sessions = [(older_session_turns, "WAITING_FOR_INPUT")] if older_session_turns is not None else []
        sessions.append((turns, session_state))
        for i, (session_turns, state) in enumerate(sessions):
            s = TaskSession(task_id=task.id, agent="mock", state=state, created_at=T0 + timedelta(seconds=i))
            db.add(s)
            db.flush()
            for n, (turn_state, stop) in enumerate(session_turns, start=1):
                db.add(Turn(id=f"{s.id}-{n}", session_id=s.id, ordinal=n, prompt="p", state=turn_state,
                            stop_reason=stop))
        return task.id


def _rows(store: Store) -> dict[str, tuple[str, str | None]]:
    views = Views(store, ExecutionStore())
    # every latest session tracked (an agent is there), so only the turns decide
    with store.session() as db:
        tracked = {s.id: True for s in db.query(TaskSession)}
    return {r["title"]: (r["bucket"], (r["attention"] or {}).get("reason"))
            for r in views.read_tasks(tracked)["tasks"]}


def test_a_task_is_placed_by_its_latest_sessions_last_ended_turn(store: Store) -> None:
    _task(store, "ended well", [("finished", "refusal"), ("finished", "end_turn")])
    _task(store, "ended refused", [("finished", "end_turn"), ("finished", "refusal")])
    _task(store, "open turn after a refusal", [("finished", "refusal"), ("open", None)])
    _task(store, "abandoned without a reason", [("finished", "error"), ("abandoned", None)])
    _task(store, "no turn", [])
    _task(store, "older session refused", [("finished", "end_turn")], older_session_turns=[("finished", "error")])
    assert _rows(store) == {
        "ended well": ("turn_finished", None),
        "ended refused": ("needs_attention", "failed"),
        "open turn after a refusal": ("needs_attention", "failed"),  # the open turn has not ended
        "abandoned without a reason": ("turn_finished", None),  # its last ended turn has no stop reason
        "no turn": ("turn_finished", None),
        "older session refused": ("turn_finished", None),  # only the latest session counts
    }


@contextmanager
def _statements(store: Store) -> Iterator[list[str]]:
    seen: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        seen.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(store.engine, "before_cursor_execute", count)


def test_the_task_list_costs_the_same_queries_for_three_tasks_and_for_thirty(store: Store) -> None:
    """One query per task made ``kandev task list`` of 1,000 tasks take ~0.6 s (Issue 24)."""
    for i in range(3):
        _task(store, f"a{i}", [("finished", "end_turn"), ("finished", "refusal")])
    with _statements(store) as few:
        _rows(store)
    for i in range(27):
        _task(store, f"b{i}", [("finished", "error"), ("finished", "end_turn")])
    with _statements(store) as many:
        rows = _rows(store)
    assert len(rows) == 30
    assert len(many) == len(few), (len(few), len(many))
