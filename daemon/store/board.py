"""The board: which bucket each task is in, from its latest session (docs/architecture.md#the-store).

A task follows its latest session (by ``created_at``, ties broken by id):
RUNNING -> running; WAITING_FOR_INPUT -> turn_finished; FAILED or CANCELLED ->
needs_attention; COMPLETED -> done. While that session is CREATED or STARTING
the task's own state decides (backlog, in_progress -> running, review ->
turn_finished, done), so a task never flickers out of review while it is
resumed automatically. A task without sessions is in backlog. A task marked done
(``kandev task done``) is in done whatever its sessions say.

``placement`` adds what only the backend knows (is the agent live, is a permission
request open, how did the last turn end) and gives each task in needs_attention its
reason in a word (``Attention``): an open permission request, a failed session or
a failed turn, a cancelled session, a turn ended for its agent's silence (``timeout``), a
session whose agent is gone.
"""

from __future__ import annotations

import re

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.store.models import Task, TaskSession
from daemon.store.states import Attention, SessionState, TaskState

BUCKETS = ("backlog", "running", "turn_finished", "needs_attention", "done")
_BY_SESSION: dict[str, str] = {
    SessionState.RUNNING: "running",
    SessionState.WAITING_FOR_INPUT: "turn_finished",
    SessionState.FAILED: "needs_attention",
    SessionState.CANCELLED: "needs_attention",
    SessionState.COMPLETED: "done",
}
_BY_TASK: dict[str, str] = {TaskState.BACKLOG: "backlog", TaskState.IN_PROGRESS: "running",
                            TaskState.REVIEW: "turn_finished", TaskState.DONE: "done"}


NEEDS_ATTENTION = "needs_attention"
# Turn stop reasons that mean the turn failed (the agent's error, its refusal, its death).
FAILED_STOPS = frozenset({"error", "refusal", "agent_exited"})
# A turn the backend ended because its agent said nothing for agents.turn_timeout_s.
TIMEOUT_STOP = "timeout"
# A turn ended by its agent's death stops counting once the session has a live agent again (it was
# resumed: the user has seen the failure and the new agent waits for them).
_DIED = "agent_exited"
# How a session's last error starts when its agent's memory bound killed it (daemon.backend.state.events):
# the typed kill (the journal's agent_killed) and its reason.
MEMORY_KILLED = "agent_killed: memory"
# How providers say a key is missing or refused (Claude Code: "Authentication required", "Invalid API key").
_AUTH_FAILURE = re.compile(r"authenticat|invalid (x-)?api[ _-]?key|api key|unauthori[sz]ed|\b401\b|login",
                           re.IGNORECASE)


def bucket_for(task_state: str, latest_session_state: str | None) -> str:
    """The bucket of a task given its state and its latest session's state (None: no session)."""
    if task_state == TaskState.DONE:
        return "done"
    if latest_session_state is None:
        return "backlog"
    return _BY_SESSION.get(latest_session_state) or _BY_TASK[task_state]


def placement(task_state: str, latest_session_state: str | None, *, live: bool | None,
              open_permission: bool = False, last_stop_reason: str | None = None) -> tuple[str, Attention | None]:
    """The bucket and, in needs_attention, the reason. ``live``: whether the latest session's agent is
    tracked (None: not known yet, e.g. startup recovery still holds it)."""
    bucket = bucket_for(task_state, latest_session_state)
    if bucket == "done" or latest_session_state is None:
        return bucket, None
    if open_permission and latest_session_state == SessionState.RUNNING:
        return NEEDS_ATTENTION, Attention.PERMISSION
    if latest_session_state == SessionState.FAILED:
        return NEEDS_ATTENTION, Attention.FAILED
    if latest_session_state == SessionState.CANCELLED:
        return NEEDS_ATTENTION, Attention.CANCELLED
    if latest_session_state == SessionState.WAITING_FOR_INPUT and last_stop_reason == TIMEOUT_STOP:
        return NEEDS_ATTENTION, Attention.TIMEOUT
    if latest_session_state == SessionState.WAITING_FOR_INPUT and last_stop_reason in FAILED_STOPS and not (
            last_stop_reason == _DIED and live):
        return NEEDS_ATTENTION, Attention.FAILED
    if latest_session_state in (SessionState.RUNNING, SessionState.WAITING_FOR_INPUT) and live is False:
        return NEEDS_ATTENTION, Attention.NO_AGENT
    return bucket, None


def attention_hint(reason: Attention | None, agent: str | None, last_error: str | None) -> str | None:
    """A known provider authentication failure names the setting that gives the agent its key; an
    agent its memory bound killed, the setting that raises the bound."""
    if reason is Attention.TIMEOUT:
        return ("its agent sent nothing until agents.turn_timeout_s ended the turn: `kandev logs SESSION` shows"
                " what it wrote; check its provider, then prompt it again")
    if reason is Attention.FAILED and agent and last_error and last_error.startswith(MEMORY_KILLED):
        return (f"{MEMORY_KILLED}: the agent went over its memory bound; raise agents.{agent}.max_memory (or"
                " agents.max_memory), then `kandev resume` its session")
    if reason is Attention.FAILED and agent and last_error and _AUTH_FAILURE.search(last_error):
        return (f"the agent's provider refused its credentials: give it a key with agents.{agent}.secret_env"
                " (`kandev agents` shows what it gets)")
    return None


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
