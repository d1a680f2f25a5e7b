"""daemon.store.board: buckets follow the latest session; CREATED/STARTING follow the task's state."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from daemon.store.board import BUCKETS, board, bucket_for
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession

T0 = datetime(2025, 1, 1, tzinfo=UTC)


@pytest.fixture
def store(any_store: Store) -> Store:
    """Each test runs on SQLite and on a real PostgreSQL server (tests/conftest.py)."""
    return any_store


def _task(store: Store, task_state: str, *session_states: str) -> str:
    """A task whose sessions were created in the order given (the last one is the latest)."""
    with store.session() as db:
        task = Task(title="t", state=task_state)
        db.add(task)
        db.flush()
        for i, state in enumerate(session_states):
            db.add(TaskSession(task_id=task.id, agent="mock", state=state, created_at=T0 + timedelta(seconds=i)))
        return task.id


@pytest.mark.parametrize(("task_state", "sessions", "bucket"), [
    ("backlog", (), "backlog"),
    ("in_progress", (), "backlog"),
    ("in_progress", ("RUNNING",), "running"),
    ("review", ("WAITING_FOR_INPUT",), "turn_finished"),
    ("review", ("FAILED",), "needs_attention"),
    ("review", ("CANCELLED",), "needs_attention"),
    ("done", ("COMPLETED",), "done"),
    # CREATED/STARTING follow the task, so a task in review stays put during automatic resume
    ("review", ("WAITING_FOR_INPUT", "STARTING"), "turn_finished"),
    ("review", ("CREATED",), "turn_finished"),
    ("in_progress", ("STARTING",), "running"),
    ("backlog", ("CREATED",), "backlog"),
    ("done", ("STARTING",), "done"),
    # the latest session decides, not an older one
    ("review", ("RUNNING", "FAILED"), "needs_attention"),
    ("in_progress", ("FAILED", "RUNNING"), "running"),
])
def test_store_board_buckets(store: Store, task_state: str, sessions: tuple[str, ...], bucket: str) -> None:
    task_id = _task(store, task_state, *sessions)
    with store.session() as db:
        result = board(db)
    assert set(result) == set(BUCKETS)
    assert result[bucket] == [task_id]
    assert sum(len(v) for v in result.values()) == 1


def test_store_board_many_tasks_in_creation_order(store: Store) -> None:
    a = _task(store, "backlog")
    b = _task(store, "in_progress", "RUNNING")
    c = _task(store, "backlog")
    with store.session() as db:
        result = board(db)
    assert result["backlog"] == [a, c] and result["running"] == [b]


def test_store_bucket_for() -> None:
    assert bucket_for("review", None) == "backlog"
    assert bucket_for("review", "STARTING") == "turn_finished"
    assert bucket_for("backlog", "COMPLETED") == "done"
