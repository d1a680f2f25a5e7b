"""The one guarded way to change a session's state (docs/architecture.md#the-store), and task state changes.

``transition_session`` is a compare-and-set: it reads the current state,
refuses unless it is one the caller expects, and writes with ``UPDATE ...
WHERE id = ? AND state = <the state it read>``. A concurrent change makes the
UPDATE match no row, and the caller gets ``TransitionConflict`` with the state
that won (after a few re-reads, in case the winner left it in another
expected state). Every edge is checked against ``ALLOWED``.

The change is published only once the enclosing SQLAlchemy session commits
(its ``after_commit`` event): each listener added with ``add_listener`` is
called with ``(session_id, from_state, to_state, reason)`` and a
``session_state`` journal entry is written. A rolled-back change publishes
nothing. Listeners run inside the commit call, so they must be quick and must
not use the database session (hand the event to a queue or event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import CursorResult, event, select, update
from sqlalchemy.orm import Session, SessionTransaction

from daemon.core.journal import log_event
from daemon.store.models import SESSION_STATES, TASK_STATES, Task, TaskSession, utcnow
from daemon.store.states import SessionState

__all__ = ["ALLOWED", "CANCELLED", "COMPLETED", "CREATED", "FAILED", "RUNNING", "STARTING", "WAITING",
           "InvalidTransition", "SessionState", "TransitionConflict", "TransitionError", "UnknownSession",
           "UnknownTask", "add_listener", "remove_listener", "set_task_state", "transition_session"]

log = logging.getLogger(__name__)

CREATED, STARTING, RUNNING = SessionState.CREATED, SessionState.STARTING, SessionState.RUNNING
WAITING, COMPLETED = SessionState.WAITING_FOR_INPUT, SessionState.COMPLETED
FAILED, CANCELLED = SessionState.FAILED, SessionState.CANCELLED

ALLOWED: Mapping[str, frozenset[str]] = {
    CREATED: frozenset({STARTING, FAILED, CANCELLED}),
    STARTING: frozenset({RUNNING, WAITING, FAILED, CANCELLED}),
    RUNNING: frozenset({WAITING, COMPLETED, FAILED, CANCELLED}),
    WAITING: frozenset({RUNNING, STARTING, COMPLETED, FAILED, CANCELLED}),
    FAILED: frozenset({STARTING}),
    CANCELLED: frozenset({STARTING}),
    COMPLETED: frozenset(),
}

Listener = Callable[[str, str, str, str], None]
_listeners: list[Listener] = []
_PENDING = "kandev_pending_transitions"
_KEEP: Any = object()


class TransitionError(Exception):
    """Base of the transition refusals."""


class UnknownSession(TransitionError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session {session_id}")
        self.session_id = session_id


class UnknownTask(TransitionError):
    def __init__(self, task_id: str) -> None:
        super().__init__(f"no task {task_id}")
        self.task_id = task_id


class TransitionConflict(TransitionError):
    """The session is not in a state the caller expected (someone else changed it)."""

    def __init__(self, current_state: str, expected_from: Collection[str] = ()) -> None:
        super().__init__(f"session is {current_state}, expected one of {sorted(expected_from)}")
        self.current_state = current_state


class InvalidTransition(TransitionError):
    """The edge is not in ``ALLOWED`` (a programming error, not a race)."""

    def __init__(self, from_state: str, to_state: str) -> None:
        super().__init__(f"transition {from_state} -> {to_state} is not allowed")
        self.from_state = from_state
        self.to_state = to_state


@dataclass(frozen=True)
class _Change:
    session_id: str
    task_id: str
    from_state: str
    to_state: str
    reason: str


def add_listener(callback: Listener) -> Callable[[], None]:
    """Call ``callback(session_id, from_state, to_state, reason)`` after each committed change.

    Returns a function that removes the listener.
    """
    _listeners.append(callback)
    return lambda: remove_listener(callback)


def remove_listener(callback: Listener) -> None:
    if callback in _listeners:
        _listeners.remove(callback)


def _publish(db: Session) -> None:
    changes: list[_Change] = db.info.pop(_PENDING, [])
    for c in changes:
        log_event(
            "session_state",
            f"session {c.session_id} {c.from_state} -> {c.to_state} ({c.reason})",
            SESSION_ID=c.session_id,
            TASK_ID=c.task_id,
            FROM_STATE=c.from_state,
            TO_STATE=c.to_state,
            REASON=c.reason,
        )
        for callback in list(_listeners):
            try:
                callback(c.session_id, c.from_state, c.to_state, c.reason)
            except Exception:
                log.exception("session-state listener %r failed", callback)


def _discard(db: Session, transaction: SessionTransaction) -> None:
    # after_commit has already published; anything left was rolled back or closed unpublished.
    if transaction.parent is None:
        db.info.pop(_PENDING, None)


def _queue(db: Session, change: _Change) -> None:
    if not event.contains(db, "after_commit", _publish):
        event.listen(db, "after_commit", _publish)
        event.listen(db, "after_transaction_end", _discard)
    db.info.setdefault(_PENDING, []).append(change)


def _check_edges(expected_from: Collection[str], to_state: str) -> None:
    if isinstance(expected_from, str):
        raise TypeError("expected_from must be a collection of states, e.g. {'RUNNING'}, not a string")
    for state in (*expected_from, to_state):
        if state not in SESSION_STATES:
            raise InvalidTransition(state, to_state)
    for state in expected_from:
        if state != to_state and to_state not in ALLOWED[state]:
            raise InvalidTransition(state, to_state)


def transition_session(
    db: Session,
    session_id: str,
    to_state: str,
    *,
    expected_from: Collection[str],
    reason: str,
    last_error: str | None = _KEEP,
    metadata_json: Mapping[str, Any] = _KEEP,
) -> TaskSession:
    """Move a session to ``to_state`` if it is in one of ``expected_from``.

    Every ``expected_from -> to_state`` edge must be allowed (a same-state
    pair is allowed and is a no-op that changes nothing, fields included).
    ``last_error`` and ``metadata_json`` (replaced whole) are written with the
    state when given. Raises ``UnknownSession``, ``TransitionConflict``,
    ``InvalidTransition``. Published after the caller's commit.
    """
    _check_edges(expected_from, to_state)
    values: dict[str, Any] = {"state": to_state, "updated_at": utcnow()}
    if last_error is not _KEEP:
        values["last_error"] = last_error
    if metadata_json is not _KEEP:
        values["metadata_json"] = dict(metadata_json)
    for _ in range(3):
        row = db.execute(
            select(TaskSession.state, TaskSession.task_id).where(TaskSession.id == session_id)
        ).one_or_none()
        if row is None:
            raise UnknownSession(session_id)
        current, task_id = row
        if current not in expected_from:
            raise TransitionConflict(current, expected_from)
        if current == to_state:
            return _load(db, session_id)
        done = cast("CursorResult[Any]", db.execute(
            update(TaskSession)
            .where(TaskSession.id == session_id, TaskSession.state == current)
            .values(**values)
            .execution_options(synchronize_session=False)
        ))
        if done.rowcount == 1:
            _queue(db, _Change(session_id, task_id, current, to_state, reason))
            return _load(db, session_id)
    raise TransitionConflict(current, expected_from)


def _load(db: Session, session_id: str) -> TaskSession:
    found = db.get(TaskSession, session_id, populate_existing=True)
    if found is None:
        raise UnknownSession(session_id)
    return found


def set_task_state(db: Session, task_id: str, state: str, *, interrupted: bool | None = None) -> Task:
    """Set a task's board state (and its interrupted flag when given)."""
    if state not in TASK_STATES:
        raise ValueError(f"unknown task state {state!r}; expected one of {TASK_STATES}")
    task = db.get(Task, task_id)
    if task is None:
        raise UnknownTask(task_id)
    task.state = state
    if interrupted is not None:
        task.interrupted = interrupted
    task.updated_at = utcnow()
    db.flush()
    return task
