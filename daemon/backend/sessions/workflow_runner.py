"""Workflow steps of a task: set them, show them, proceed to the next one.

Entering a step is persisted first; then its context reset (``daemon.backend.sessions.context_reset``),
then its automatic prompt (``daemon.backend.sessions.sessions``). A failed reset blocks the prompt
(RESETCFG-11) and the step says why (``blocked``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy import select

from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions.context_reset import ContextReset
from daemon.backend.sessions.live import conflict
from daemon.backend.sessions.sessions import SessionService
from daemon.core.journal import log_event
from daemon.store import workflow_steps as wf
from daemon.store.models import Task, TaskSession
from daemon.store.states import SessionState
from ipc.errors import ErrorCode, IpcError


class WorkflowRunner:
    def __init__(self, backend: BackendContext, sessions: SessionService, resets: ContextReset) -> None:
        self.backend = backend
        self.sessions = sessions
        self.resets = resets
        self.task_locks: dict[str, asyncio.Lock] = {}

    def _task_lock(self, task_id: str) -> asyncio.Lock:
        return self.task_locks.setdefault(task_id, asyncio.Lock())

    async def set_steps(self, task_id: str, steps: list[wf.StepSpec]) -> dict[str, Any]:
        async with self._task_lock(task_id):
            with self.backend.store.session() as db:
                if db.get(Task, task_id) is None:
                    raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
                try:
                    wf.set_steps(db, task_id, steps)
                except wf.WorkflowError as exc:
                    raise conflict(str(exc)) from None
                return {"task_id": task_id, "steps": wf.describe(wf.load_steps(db, task_id))}

    async def describe(self, task_id: str) -> dict[str, Any]:
        with self.backend.store.session() as db:
            if db.get(Task, task_id) is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
            steps = wf.load_steps(db, task_id)
            here = wf.current(steps)
            return {"task_id": task_id, "current": here.name if here else None, "steps": wf.describe(steps)}

    def _latest_session(self, db: Any, task_id: str) -> TaskSession | None:
        latest: TaskSession | None = db.scalars(
            select(TaskSession).where(TaskSession.task_id == task_id)
            .order_by(TaskSession.created_at.desc(), TaskSession.id.desc()).limit(1)).first()
        return latest

    def _step_status(self, task_id: str, position: int, status: str, detail: str) -> None:
        with self.backend.store.session() as db:
            for step in wf.load_steps(db, task_id):
                if step.position == position:
                    step.status = status
                    step.detail = detail

    async def proceed(self, task_id: str) -> dict[str, Any]:
        """Enter the next step (persisted), then its reset, then its prompt; a failed reset blocks
        the prompt (RESETCFG-11)."""
        b = self.backend
        async with self._task_lock(task_id):
            with b.store.session() as db:
                if db.get(Task, task_id) is None:
                    raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
                steps = wf.load_steps(db, task_id)
                try:
                    target = wf.next_step(steps)
                except wf.WorkflowError as exc:
                    raise conflict(str(exc)) from None
                needs_agent = bool(target.reset_context or target.prompt)
                latest = self._latest_session(db, task_id)
                session_id = latest.id if latest is not None else None
                if needs_agent:
                    ex = b.executions.executions.get(session_id) if session_id else None
                    if latest is None or ex is None or latest.state != SessionState.WAITING_FOR_INPUT:
                        raise conflict(
                            f"step {target.name!r} resets context or prompts: the task's session must have a"
                            " running agent waiting for input"
                            + (f" (session {session_id} is {latest.state})" if latest is not None else ""))
                wf.enter(db, steps, target)
                position, name = target.position, target.name
                reset, prompt = bool(target.reset_context), target.prompt
            result: dict[str, Any] = {"task_id": task_id, "step": name, "position": position,
                                      "session_id": session_id, "reset": None, "prompt": None}
            if reset:
                assert session_id is not None
                try:
                    result["reset"] = await self.resets.reset_context(session_id, origin=f"workflow step {name}")
                except IpcError as exc:
                    detail = f"context reset failed: {exc.message}; the automatic prompt was not sent"
                    self._step_status(task_id, position, "blocked", detail)
                    log_event("workflow_step_blocked", f"task {task_id} step {name!r}: {detail}", priority=4,
                              TASK_ID=task_id, SESSION_ID=session_id, STEP=name)
                    raise IpcError(exc.code, f"entered step {name!r}, but {detail}", exc.retryable) from None
            if prompt:
                assert session_id is not None
                try:
                    started = await self.sessions.prompt(session_id, prompt, wait=False)
                except IpcError as exc:
                    detail = f"the automatic prompt was refused: {exc.message}"
                    self._step_status(task_id, position, "blocked", detail)
                    raise IpcError(exc.code, f"entered step {name!r}, but {detail}", exc.retryable) from None
                result["prompt"] = {"sent": True, "turn_id": started["turn_id"], "text": prompt}
            self._step_status(task_id, position, "active", "entered")
            log_event("workflow_step_entered", f"task {task_id} entered step {name!r}", TASK_ID=task_id, STEP=name)
            return result
