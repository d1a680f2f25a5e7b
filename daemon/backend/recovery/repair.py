"""The stale-execution repair path: what a session whose agent is gone becomes.

``repair_interrupted`` is the one repair (the inventory row no longer claims a live process, open
turns abandoned, the session waiting for input with its resume token, the task in review marked
interrupted); startup reconciliation (``daemon.backend.recovery.recovery``), a stopped or lost agent
(``daemon.backend.sessions.lifecycle``) and ``repair_lost_server``, for a control server that died under a
running backend (``daemon.backend.control.servers``), all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from daemon.backend.cluster.identity import ClusterIdentity
from daemon.backend.recovery.liveness import live_groups, stop_leftover_group
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.core.journal import log_event
from daemon.store import transcript, transitions
from daemon.store.models import ExecutorRunning, Task, TaskSession, Turn
from daemon.store.states import InventoryStatus, SessionState, TaskState, TurnState

ACTIVE_STATES = (SessionState.STARTING, SessionState.RUNNING)


def iso_utc(now: datetime) -> str:
    return now.isoformat().replace("+00:00", "Z")


def repair_interrupted(
    db: Any,
    session_id: str,
    now: datetime,
    *,
    reason: str = "interrupted by backend restart",
    interruption: dict[str, Any] | None = None,
    turn_error: str | None = None,
) -> None:
    """The stale-execution repair path: the row no longer claims a live process (resume token
    and worktree kept), open turns are abandoned, an active session waits for input and its
    task goes to review marked interrupted. ``interruption`` (why and when) is kept on the row
    until the session gets an agent again; ``session show`` reports it. ``turn_error``: why, in
    words, on each abandoned turn (follow, the transcript and the board show it after
    ``interrupted``)."""
    row = db.get(ExecutorRunning, session_id)
    if row is not None and row.status == InventoryStatus.LIVE:
        row.status = InventoryStatus.STALE
        row.updated_at = now
        if interruption is not None:
            row.metadata_json = {**(row.metadata_json or {}), "interruption": interruption}
    session = db.get(TaskSession, session_id)
    if session is None or session.state not in ACTIVE_STATES:
        return
    for turn in db.scalars(select(Turn).where(Turn.session_id == session_id, Turn.state == TurnState.OPEN)):
        turn.state = TurnState.ABANDONED
        turn.stop_reason = "interrupted"
        turn.error = turn_error
        turn.ended_at = now
    transitions.transition_session(
        db, session_id, SessionState.WAITING_FOR_INPUT, expected_from={session.state}, reason=reason,
    )
    task = db.get(Task, session.task_id)
    if task is not None and task.state != TaskState.DONE:  # a task the user marked done stays done
        transitions.set_task_state(db, session.task_id, TaskState.REVIEW, interrupted=True)


@dataclass(frozen=True)
class LostAgent:
    """An agent that ran on a control server that is gone: what identifies it, and how far its
    event stream was received."""

    session_id: str
    agent: AgentIdentity
    last_seq: int


def repair_lost_server(
    db: Any, *, endpoint: str, tracked: list[LostAgent], reason: str, now: datetime,
    identity: ClusterIdentity | None = None,
) -> list[str]:
    """A control server died under a running backend: make every session that lived on it what
    startup recovery would make it with no server left (reconciliation's repair path).

    The sessions are the executions the backend tracked on it plus every live inventory row that
    names its endpoint. For each: its agent is checked by its pid and start and anything left of
    its process group is killed (``liveness.stop_leftover_group``); one transcript note says that
    the events the server held but never delivered are lost, with the last seq received; then
    the repair (open turn ``interrupted``, session waiting for input and resumable with its
    token, task in review, marked interrupted). Returns the sessions repaired. In a cluster only this
    host's rows count (``identity``): another host's server may have the same socket path."""
    own = (identity or ClusterIdentity()).own_sessions()
    agents = {a.session_id: a for a in tracked}
    rows = db.scalars(
        select(ExecutorRunning).join(TaskSession, TaskSession.id == ExecutorRunning.session_id)
        .where(ExecutorRunning.status == InventoryStatus.LIVE, ExecutorRunning.endpoint == endpoint, own)
    ).all()
    for row in rows:
        if row.session_id not in agents:
            agents[row.session_id] = LostAgent(row.session_id, AgentIdentity.recorded(row),
                                               row.last_event_seq or 0)
    interruption = {"cause": "control_server_lost", "reason": reason, "at": iso_utc(now)}
    repaired: list[str] = []
    groups = live_groups() if agents else set()
    for session_id, lost in sorted(agents.items()):
        leftover = stop_leftover_group(lost.agent, groups)
        if leftover != "gone":
            done = "its process group was killed" if leftover == "killed" else "identity unknown, left alone"
            log_event("agent_group_leftover", f"session {session_id}: agent pid {lost.agent.pid} outlived its"
                      f" control server: {done}", priority=4, SESSION_ID=session_id,
                      AGENT_PID=lost.agent.pid, OUTCOME=leftover)
        session = db.get(TaskSession, session_id)
        if session is None:
            continue
        row = db.get(ExecutorRunning, session_id)
        last_seq = max(lost.last_seq, (row.last_event_seq or 0) if row is not None else 0)
        transcript.append(
            db, session_id, role="system", kind="control_server_lost",
            text=(f"The control server was lost ({reason}) and the agent with it. Events it held for this session"
                  f" but never delivered are lost; the last event received was seq {last_seq}. The conversation"
                  " can continue: kandev resume " + session_id),
            created_at=now,
        )
        repair_interrupted(db, session_id, now, reason=f"interrupted: control server lost ({reason})",
                           interruption={**interruption, "last_seq": last_seq})
        repaired.append(session_id)
        log_event("session_interrupted", f"session {session_id} interrupted: control server lost ({reason});"
                  f" last event received: seq {last_seq}", priority=4, SESSION_ID=session_id,
                  TASK_ID=session.task_id, REASON="control_server_lost", LAST_SEQ=last_seq)
    return repaired
