"""Rows the store tests start from, written straight into a ``Store`` (no daemon involved)."""

from __future__ import annotations

from daemon.store.db import Store
from daemon.store.models import Task, TaskSession


def new_session(store: Store, state: str = "CREATED", *, workspace: str | None = None) -> str:
    """A task (its ``workspace``, if given) with one mock session in ``state``, committed; the
    session's id."""
    with store.session() as db:
        task = Task(title="t", workspace=workspace)
        db.add(task)
        db.flush()
        session = TaskSession(task_id=task.id, agent="mock", state=state)
        db.add(session)
        db.flush()
        return session.id
