"""The board: which bucket each task is in, from its latest session (docs/architecture.md#the-store).

A task follows its latest session (by ``created_at``, ties broken by id):
RUNNING -> running; WAITING_FOR_INPUT -> turn_finished; FAILED or CANCELLED ->
needs_attention; COMPLETED -> done. While that session is CREATED or STARTING
the task's own state decides (backlog, in_progress -> running, review ->
turn_finished, done), so a task never flickers out of review while it is
resumed automatically. A task without sessions is in backlog.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.store.models import Task, TaskSession

BUCKETS = ("backlog", "running", "turn_finished", "needs_attention", "done")
_BY_SESSION = {
    "RUNNING": "running",
    "WAITING_FOR_INPUT": "turn_finished",
    "FAILED": "needs_attention",
    "CANCELLED": "needs_attention",
    "COMPLETED": "done",
}
_BY_TASK = {"backlog": "backlog", "in_progress": "running", "review": "turn_finished", "done": "done"}


def bucket_for(task_state: str, latest_session_state: str | None) -> str:
    """The bucket of a task given its state and its latest session's state (None: no session)."""
    if latest_session_state is None:
        return "backlog"
    return _BY_SESSION.get(latest_session_state) or _BY_TASK[task_state]


def board(db: Session) -> dict[str, list[str]]:
    """Every task id by bucket; each bucket in task creation order."""
    ranked = select(
        TaskSession.task_id,
        TaskSession.state,
        func.row_number()
        .over(partition_by=TaskSession.task_id, order_by=(TaskSession.created_at.desc(), TaskSession.id.desc()))
        .label("rank"),
    ).subquery()
    latest = select(ranked.c.task_id, ranked.c.state).where(ranked.c.rank == 1).subquery()
    rows = db.execute(
        select(Task.id, Task.state, latest.c.state)
        .outerjoin(latest, latest.c.task_id == Task.id)
        .order_by(Task.created_at, Task.id)
    ).all()
    result: dict[str, list[str]] = {b: [] for b in BUCKETS}
    for task_id, task_state, session_state in rows:
        result[bucket_for(task_state, session_state)].append(task_id)
    return result
