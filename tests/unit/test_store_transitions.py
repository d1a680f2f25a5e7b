"""daemon.store.transitions: the one guarded session-state transition, publication after commit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from daemon.store import transitions as tr
from daemon.store.db import Store
from daemon.store.models import SESSION_STATES, TaskSession
from daemon.store.transitions import (
    ALLOWED,
    InvalidTransition,
    TransitionConflict,
    UnknownSession,
    UnknownTask,
    set_task_state,
    transition_session,
)
from tests.support.store_rows import new_session

Event = tuple[str, str, str, str]


@pytest.fixture
def store(any_store: Store) -> Store:
    """Each test runs on SQLite and on a real PostgreSQL server (tests/conftest.py)."""
    return any_store


@pytest.fixture
def published() -> Iterator[list[Event]]:
    events: list[Event] = []
    remove = tr.add_listener(lambda *a: events.append(a))
    yield events
    remove()


def _state(store: Store, sid: str) -> str:
    with store.session() as db:
        row = db.get(TaskSession, sid)
        assert row is not None
        return row.state


EDGES = [(f, t) for f in SESSION_STATES for t in SESSION_STATES if f != t]


@pytest.mark.parametrize(("frm", "to"), EDGES)
def test_store_transition_table(store: Store, frm: str, to: str) -> None:
    sid = new_session(store, frm)
    with store.session() as db:
        if to in ALLOWED[frm]:
            assert transition_session(db, sid, to, expected_from={frm}, reason="test").state == to
        else:
            with pytest.raises(InvalidTransition):
                transition_session(db, sid, to, expected_from={frm}, reason="test")
    assert _state(store, sid) == (to if to in ALLOWED[frm] else frm)


def test_store_transition_table_is_the_design() -> None:
    assert ALLOWED["COMPLETED"] == frozenset()
    assert ALLOWED["FAILED"] == ALLOWED["CANCELLED"] == {"STARTING"}
    assert ALLOWED["WAITING_FOR_INPUT"] == {"RUNNING", "STARTING", "COMPLETED", "FAILED", "CANCELLED"}


def test_store_transition_same_state_is_noop(store: Store, published: list[Event]) -> None:
    sid = new_session(store, "RUNNING")
    with store.session() as db:
        row = transition_session(db, sid, "RUNNING", expected_from={"RUNNING"}, reason="x", last_error="e")
        assert row.state == "RUNNING" and row.last_error is None
    assert published == []


def test_store_transition_conflict_and_unknown(store: Store) -> None:
    sid = new_session(store, "RUNNING")
    with store.session() as db:
        with pytest.raises(TransitionConflict) as e:
            transition_session(db, sid, "RUNNING", expected_from={"STARTING"}, reason="x")
        assert e.value.current_state == "RUNNING"
        with pytest.raises(UnknownSession):
            transition_session(db, "nope", "FAILED", expected_from={"RUNNING"}, reason="x")
        with pytest.raises(InvalidTransition):
            transition_session(db, sid, "BOGUS", expected_from={"RUNNING"}, reason="x")


def test_store_transition_cas_two_sessions(store: Store, published: list[Event]) -> None:
    """Two units of work race from WAITING_FOR_INPUT; the second loses cleanly with the winner's state."""
    sid = new_session(store, "WAITING_FOR_INPUT")
    with store.session() as a, store.session() as b:
        assert a.get(TaskSession, sid).state == "WAITING_FOR_INPUT"  # type: ignore[union-attr]
        assert b.get(TaskSession, sid).state == "WAITING_FOR_INPUT"  # type: ignore[union-attr]
        transition_session(b, sid, "RUNNING", expected_from={"WAITING_FOR_INPUT"}, reason="prompt")
        b.commit()
        with pytest.raises(TransitionConflict) as e:
            transition_session(a, sid, "CANCELLED", expected_from={"WAITING_FOR_INPUT"}, reason="cancel")
        assert e.value.current_state == "RUNNING"
    assert _state(store, sid) == "RUNNING"
    assert published == [(sid, "WAITING_FOR_INPUT", "RUNNING", "prompt")]


def test_store_transition_cas_change_between_read_and_write(
    store: Store, published: list[Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state changes after the transition read it: the guarded UPDATE matches nothing -> conflict."""
    sid = new_session(store, "WAITING_FOR_INPUT")
    with store.session() as a:
        real = a.execute
        calls = 0

        def racing_execute(*args: object, **kw: object) -> object:
            nonlocal calls
            calls += 1
            result = real(*args, **kw)  # type: ignore[arg-type]
            if calls == 1:  # just after the state read: another unit of work wins
                with store.session() as b:
                    transition_session(b, sid, "COMPLETED", expected_from={"WAITING_FOR_INPUT"}, reason="won")
            return result

        monkeypatch.setattr(a, "execute", racing_execute)
        with pytest.raises(TransitionConflict) as e:
            transition_session(a, sid, "RUNNING", expected_from={"WAITING_FOR_INPUT"}, reason="lost")
        assert e.value.current_state == "COMPLETED"
    assert _state(store, sid) == "COMPLETED"
    assert published == [(sid, "WAITING_FOR_INPUT", "COMPLETED", "won")]


def test_store_transition_fields_written(store: Store) -> None:
    sid = new_session(store, "RUNNING")
    with store.session() as db:
        row = transition_session(db, sid, "FAILED", expected_from={"RUNNING"}, reason="x", last_error="boom",
                                 metadata_json={"acp": {"session_id": "p1"}})
        assert row.last_error == "boom"
    with store.session() as db:
        row = db.get(TaskSession, sid)
        assert row is not None and row.metadata_json == {"acp": {"session_id": "p1"}}
        transition_session(db, sid, "STARTING", expected_from={"FAILED"}, reason="resume", last_error=None)
    with store.session() as db:
        row = db.get(TaskSession, sid)
        assert row is not None and row.last_error is None and row.metadata_json["acp"]["session_id"] == "p1"


def test_store_transition_published_only_after_commit(store: Store, published: list[Event]) -> None:
    sid = new_session(store)
    with store.session() as db:
        transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="start")
        assert published == []
    assert published == [(sid, "CREATED", "STARTING", "start")]


def test_store_transition_not_published_after_rollback(store: Store, published: list[Event]) -> None:
    sid = new_session(store)
    with pytest.raises(RuntimeError), store.session() as db:
        transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="start")
        raise RuntimeError
    assert published == [] and _state(store, sid) == "CREATED"
    with store.session() as db:  # a later commit in a fresh unit of work does not resurrect it
        transition_session(db, sid, "CANCELLED", expected_from={"CREATED"}, reason="cancel")
    assert published == [(sid, "CREATED", "CANCELLED", "cancel")]


def test_store_transition_same_session_object_reused_after_rollback(store: Store, published: list[Event]) -> None:
    sid = new_session(store)
    with store._sessions() as db:  # noqa: SLF001 - one Session object across two transactions
        transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="first")
        db.rollback()
        db.commit()
        assert published == []
        transition_session(db, sid, "FAILED", expected_from={"CREATED"}, reason="second")
        db.commit()
    assert published == [(sid, "CREATED", "FAILED", "second")]


def test_store_transition_listener_failure_does_not_break_commit(store: Store, published: list[Event]) -> None:
    def bad(*_: str) -> None:
        raise RuntimeError("listener bug")

    remove = tr.add_listener(bad)
    try:
        sid = new_session(store)
        with store.session() as db:
            transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="start")
    finally:
        remove()
    assert len(published) == 1 and _state(store, sid) == "STARTING"


def test_store_transition_writes_journal_entry(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    entries: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(tr, "log_event", lambda event, message, **f: entries.append((event, f)))
    sid = new_session(store)
    with store.session() as db:
        transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="start")
        assert entries == []
    (event, fields), = entries
    assert event == "session_state"
    assert fields["SESSION_ID"] == sid and fields["FROM_STATE"] == "CREATED" and fields["TO_STATE"] == "STARTING"
    assert fields["REASON"] == "start" and fields["TASK_ID"]


def test_store_set_task_state(store: Store) -> None:
    sid = new_session(store)
    with store.session() as db:
        task_id = db.get(TaskSession, sid).task_id  # type: ignore[union-attr]
        task = set_task_state(db, task_id, "review", interrupted=True)
        assert (task.state, task.interrupted) == ("review", True)
        assert set_task_state(db, task_id, "in_progress").interrupted is True
        with pytest.raises(ValueError):
            set_task_state(db, task_id, "limbo")
        with pytest.raises(UnknownTask):
            set_task_state(db, "nope", "done")
