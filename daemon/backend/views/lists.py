"""Read-only views for people: ``task_list``, ``task_show`` and ``session_list`` with ``detail``.

``kandev task list``, ``kandev task show TASK``, ``kandev board`` and ``kandev session
list`` need more than ids: titles, buckets (with the reason a task needs its user), agents, the last
turn, the workflow step. These ops return that in one answer each. Every read here is a plain blocking query: the handlers run them
in a worker thread with their own store session, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.backend.cluster.membership import Cluster
from daemon.backend.cluster.other_hosts import OtherHosts
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.views.quiet_report import QuietOf
from daemon.backend.views.session_view import permissions
from daemon.store import workflow_steps as wf
from daemon.store.board import BUCKETS, attention_hint, placement
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession, Turn, WorkflowStep
from daemon.store.states import SessionState, TurnState
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]
_IDS_PER_QUERY = 500  # session ids in one IN list (well under SQLite's and PostgreSQL's limits)


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def _latest_sessions(db: Session, task_ids: list[str] | None = None) -> dict[str, TaskSession]:
    """Each task's latest session (by creation, ties by id), as the board ranks them."""
    ranked = select(
        TaskSession.id,
        func.row_number()
        .over(partition_by=TaskSession.task_id, order_by=(TaskSession.created_at.desc(), TaskSession.id.desc()))
        .label("rank"),
    )
    if task_ids is not None:
        ranked = ranked.where(TaskSession.task_id.in_(task_ids))
    sub = ranked.subquery()
    latest = db.scalars(select(TaskSession).join(sub, sub.c.id == TaskSession.id).where(sub.c.rank == 1))
    return {s.task_id: s for s in latest}


LastStop = tuple[str | None, str | None]  # the last ended turn's (stop reason, error)


def _last_stop_reasons(db: Session, session_ids: list[str]) -> dict[str, LastStop]:
    """Each given session's last ended turn's stop reason (None: it ended without one) and error;
    sessions with no ended turn are absent. One query per ``_IDS_PER_QUERY`` sessions, not one per task."""
    reasons: dict[str, LastStop] = {}
    for start in range(0, len(session_ids), _IDS_PER_QUERY):
        ranked = select(
            Turn.session_id, Turn.stop_reason, Turn.error,
            func.row_number().over(partition_by=Turn.session_id, order_by=Turn.ordinal.desc()).label("rank"),
        ).where(Turn.session_id.in_(session_ids[start:start + _IDS_PER_QUERY]), Turn.state != TurnState.OPEN).subquery()
        reasons.update((sid, (reason, error)) for sid, reason, error in db.execute(
            select(ranked.c.session_id, ranked.c.stop_reason, ranked.c.error).where(ranked.c.rank == 1)).all())
    return reasons


def _interrupted(last: LastStop | None) -> str | None:
    """``interrupted: WHY`` when the last turn was interrupted (WHY: e.g. the backend stopped and
    survival is off), else None."""
    if last is None or last[0] != "interrupted":
        return None
    return f"interrupted: {last[1]}" if last[1] else "interrupted"


def _workflow_summary(steps: list[WorkflowStep]) -> dict[str, Any] | None:
    if not steps:
        return None
    here = wf.current(steps)
    return {"step": here.name if here else None, "position": here.position if here else None,
            "status": here.status if here else None, "steps": len(steps)}


class Views:
    """The handlers of ``api.VIEW_OPS`` (and the detail of ``session_list``)."""

    def __init__(self, store: Store, executions: ExecutionStore, resuming: set[str] | None = None,
                 quiet: QuietOf | None = None,
                 out_of_space: Callable[[], dict[str, Any] | None] | None = None,
                 cluster: Cluster | None = None) -> None:
        self.store = store
        # several hosts (Issue 47): each session's host and whether that host is reachable
        self.cluster = cluster
        self.executions = executions
        self.resuming = resuming if resuming is not None else set()  # the backend resumes these itself
        # session id, agent -> its running turn's silence (daemon.backend.views.quiet_report), or None
        self.quiet = quiet if quiet is not None else (lambda _sid, _agent: None)
        # ``kandev status``'s store.out_of_space, which task_list carries for the board's header
        self.out_of_space = out_of_space if out_of_space is not None else (lambda: None)

    def _add_quiet(self, summary: dict[str, Any] | None) -> None:
        """A session summary's ``quiet`` (read on the loop, after the store's rows)."""
        if summary is not None:
            summary["quiet"] = self.quiet(summary["session_id"], summary.get("agent"))

    def tracked(self) -> dict[str, bool]:
        """Session id -> re-tracked, of every execution this backend tracks (read on the loop); a
        session startup recovery still holds maps to None (whether it has an agent is not known yet)."""
        tracked: dict[str, Any] = {sid: None for sid in (*self.executions.guards, *self.resuming)}
        tracked.update({sid: bool(ex.retracked) for sid, ex in self.executions.executions.items()})
        return tracked

    @staticmethod
    def _session_summary(s: TaskSession, tracked: dict[str, bool], others: OtherHosts) -> dict[str, Any]:
        """In a cluster also ``host``: the cluster host that drives it, and ``host_state``: that host's
        ``ready``, ``unreachable`` or ``stopped`` (a session of a host that is not ready shows its last
        known state, never live); a single host's summaries keep their shape."""
        summary = {"session_id": s.id, "agent": s.agent, "state": s.state, "last_error": s.last_error,
                   "created_at": _iso(s.created_at), "passthrough": bool(s.passthrough),
                   "live": tracked.get(s.id) is not None, "retracked": bool(tracked.get(s.id))}
        return summary if others.own is None else {**summary, "host": s.host, "host_state": others.host_state(s.host)}

    @staticmethod
    def _placement(db: Session, task: Task, latest: TaskSession | None, tracked: dict[str, bool],
                   last_stops: dict[str, LastStop]) -> tuple[str, dict[str, Any] | None]:
        """The task's bucket and, in needs_attention, {reason, hint}; ``last_stops`` from
        ``_last_stop_reasons`` for the latest session."""
        if latest is None:
            return placement(task.state, None, live=None)[0], None
        last_stop = (last_stops.get(latest.id) or (None, None))[0]
        open_permission = latest.state == SessionState.RUNNING and any(
            p["state"] == "open" for p in permissions(db, latest.id))
        live = None if latest.id in tracked and tracked[latest.id] is None else latest.id in tracked
        bucket, reason = placement(task.state, latest.state, live=live, open_permission=open_permission,
                                   last_stop_reason=last_stop)
        if reason is None:
            return bucket, None
        return bucket, {"reason": reason.value, "hint": attention_hint(reason, latest.agent, latest.last_error)}

    def _task_row(self, db: Session, task: Task, latest: TaskSession | None, sessions: int,
                  steps: list[WorkflowStep], tracked: dict[str, bool],
                  last_stops: dict[str, LastStop], others: OtherHosts) -> dict[str, Any]:
        bucket, attention = self._placement(db, task, latest, tracked, last_stops)
        return {
            "task_id": task.id,
            "title": task.title,
            "workspace": task.workspace,
            "executor": task.executor,
            "state": task.state,
            "bucket": bucket,
            "attention": attention,
            # the latest session's last turn, when a stop interrupted it: why (the board shows it)
            "interrupted": _interrupted(last_stops.get(latest.id)) if latest is not None else None,
            "created_at": _iso(task.created_at),
            "sessions": sessions,
            "latest_session": self._session_summary(latest, tracked, others) if latest is not None else None,
            "workflow": _workflow_summary(steps),
        }

    # -- reads (worker thread) ---------------------------------------------------

    def read_tasks(self, tracked: dict[str, bool]) -> dict[str, Any]:
        with self.store.session() as db:
            tasks = list(db.scalars(select(Task).order_by(Task.created_at, Task.id)))
            latest = _latest_sessions(db)
            counts = dict(db.execute(select(TaskSession.task_id, func.count()).group_by(TaskSession.task_id)).all())
            steps: dict[str, list[WorkflowStep]] = {}
            for step in db.scalars(select(WorkflowStep).order_by(WorkflowStep.task_id, WorkflowStep.position)):
                steps.setdefault(step.task_id, []).append(step)
            last_stops = _last_stop_reasons(db, [s.id for s in latest.values()])
            others = OtherHosts.read(db, self.cluster)
            tracked = others.merged(tracked, [(s.id, s.host) for s in latest.values()])
            return {"tasks": [self._task_row(db, t, latest.get(t.id), int(counts.get(t.id, 0)), steps.get(t.id, []),
                                             tracked, last_stops, others) for t in tasks]}

    def read_task(self, task_id: str, tracked: dict[str, bool]) -> dict[str, Any]:
        with self.store.session() as db:
            task = db.get(Task, task_id)
            if task is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
            sessions = list(db.scalars(select(TaskSession).where(TaskSession.task_id == task_id)
                                       .order_by(TaskSession.created_at.desc(), TaskSession.id.desc())))
            steps = wf.load_steps(db, task_id)
            last_stops = _last_stop_reasons(db, [sessions[0].id] if sessions else [])
            others = OtherHosts.read(db, self.cluster)
            tracked = others.merged(tracked, [(s.id, s.host) for s in sessions])
            row = self._task_row(db, task, sessions[0] if sessions else None, len(sessions), steps, tracked,
                                 last_stops, others)
            row["session_list"] = [self._session_summary(s, tracked, others) for s in sessions]
            row["steps"] = wf.describe(steps)
            return row

    def read_session_rows(self, tracked: dict[str, bool]) -> dict[str, Any]:
        with self.store.session() as db:
            ranked = select(
                Turn.session_id, Turn.ordinal, Turn.state, Turn.stop_reason, Turn.started_at, Turn.ended_at,
                func.row_number().over(partition_by=Turn.session_id, order_by=Turn.ordinal.desc()).label("rank"),
            ).subquery()
            last_turns = {
                r.session_id: {"ordinal": r.ordinal, "state": r.state, "stop_reason": r.stop_reason,
                               "started_at": _iso(r.started_at), "ended_at": _iso(r.ended_at)}
                for r in db.execute(select(ranked).where(ranked.c.rank == 1))
            }
            rows = db.execute(
                select(TaskSession, Task.title).join(Task, Task.id == TaskSession.task_id)
                .order_by(TaskSession.created_at.desc(), TaskSession.id.desc())
            ).all()
            others = OtherHosts.read(db, self.cluster)
            tracked = others.merged(tracked, [(s.id, s.host) for s, _title in rows])
            sessions = []
            for session, title in rows:
                row = self._session_summary(session, tracked, others)
                row.update(task_id=session.task_id, task_title=title, last_turn=last_turns.get(session.id))
                sessions.append(row)
            return {"sessions": sessions}

    # -- handlers --------------------------------------------------------------

    async def _of_one_moment(self, read: Callable[[dict[str, bool]], dict[str, Any]]) -> dict[str, Any]:
        """``read(tracked)`` off the loop, with the rows and what this backend tracks of one moment:
        a launch commits its session's state and starts tracking it in one step of the loop, which
        can fall during the read (then a session waiting for input would be shown without its
        agent). If tracking changed meanwhile, read again (at most three times in all)."""
        for _ in range(3):
            before = self.tracked()
            result = await asyncio.to_thread(read, before)
            if self.tracked() == before:
                break
        return result

    async def op_task_list(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        result = await self._of_one_moment(self.read_tasks)
        for task in result["tasks"]:
            self._add_quiet(task["latest_session"])
        result["store_out_of_space"] = self.out_of_space()
        return result

    async def op_task_show(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        result = await self._of_one_moment(functools.partial(self.read_task, args["task_id"]))
        self._add_quiet(result["latest_session"])
        for summary in result["session_list"]:
            self._add_quiet(summary)
        return result

    async def op_board(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """Task ids by bucket (creation order), the same placement as ``task_list`` (whose rows say
        why a task needs attention: ``attention``)."""
        tasks = (await self._of_one_moment(self.read_tasks))["tasks"]
        return {b: [t["task_id"] for t in tasks if t["bucket"] == b] for b in BUCKETS}

    async def session_rows(self) -> dict[str, Any]:
        """``session_list`` with ``detail``: newest first, with agent, task title and last turn."""
        result = await self._of_one_moment(self.read_session_rows)
        for summary in result["sessions"]:
            self._add_quiet(summary)
        return result

    def handlers(self) -> dict[str, Handler]:
        return {"task_list": self.op_task_list, "task_show": self.op_task_show, "board": self.op_board}
