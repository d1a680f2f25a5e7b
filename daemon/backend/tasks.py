"""Tasks: create one (with its workspace), mark one done (``kandev task done``) and take it back
(``kandev task reopen``).

A done task is in the board's done bucket whatever its sessions say, until a new prompt (which puts
it in progress again) or ``reopen``. It is refused while a session of the task runs a turn or starts
an agent: the turn's end would put the task back in review at once.

A task's workspace is an existing absolute directory (``local`` with ``--workspace``), a fresh
directory under the home's worktrees (``local`` without one), or a git worktree of the given
repository on branch ``kandev/<task id>`` (``worktree``; created off the event loop).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select

from daemon.backend.worktree import add_worktree
from daemon.credentials.scope import workspace_origin_url
from daemon.journal import log_event
from daemon.paths import Paths
from daemon.store.board import bucket_for
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession
from daemon.store.states import TaskState
from ipc.errors import ErrorCode, IpcError

EXECUTORS = ("local", "worktree")


def _now() -> datetime:
    return datetime.now(UTC)


class TaskService:
    def __init__(self, store: Store, paths: Paths) -> None:
        self.store = store
        self.paths = paths

    async def create(self, title: str, executor: str, workspace: str | None) -> dict[str, str]:
        title = title.strip()
        if not title:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "title must not be empty")
        if executor not in EXECUTORS:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"executor must be one of {', '.join(EXECUTORS)}")
        task_id = uuid.uuid4().hex
        workspace = await self._workspace_for(task_id, workspace, executor)
        # Recorded now, before any agent runs in it: the repository its sessions' git may reach.
        git_remote = await asyncio.to_thread(workspace_origin_url, workspace) if workspace else None
        with self.store.session() as db:
            db.add(
                Task(
                    id=task_id,
                    title=title,
                    workspace=workspace,
                    git_remote=git_remote,
                    executor=executor,
                    state=TaskState.BACKLOG,
                    interrupted=False,
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
        log_event("task_created", f"task {task_id} created", TASK_ID=task_id)
        return {"task_id": task_id, "workspace": workspace}

    async def _workspace_for(self, task_id: str, workspace: str | None, executor: str) -> str:
        if executor == "worktree":
            if not workspace:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "executor 'worktree' needs --workspace (a git repository)")
            target = self.paths.worktrees_dir / task_id
            await add_worktree(workspace, target, f"kandev/{task_id}")  # off the loop, hooks disabled
            return str(target)
        if workspace:
            path = Path(workspace)
            if not path.is_absolute() or not path.is_dir():
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"workspace {workspace!r} is not an existing absolute directory")
            return str(path)
        target = self.paths.worktrees_dir / task_id
        target.mkdir(parents=True, exist_ok=True)
        return str(target)

    def _set_done(self, task_id: str, done: bool) -> dict[str, str]:
        with self.store.session() as db:
            task = db.get(Task, task_id)
            if task is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
            sessions = list(db.scalars(select(TaskSession).where(TaskSession.task_id == task_id)
                                       .order_by(TaskSession.created_at.desc(), TaskSession.id.desc())))
            if done:
                busy = [s for s in sessions if s.state in ("RUNNING", "STARTING")]
                if busy:
                    raise IpcError(ErrorCode.CONFLICT, f"task {task_id} is not done: session {busy[0].id} is"
                                   f" {busy[0].state} (kandev cancel {busy[0].id[:8]} ends its turn)")
                state = TaskState.DONE
            else:
                if task.state != TaskState.DONE:
                    raise IpcError(ErrorCode.CONFLICT, f"task {task_id} is not done (it is {task.state})")
                state = TaskState.REVIEW if sessions else TaskState.BACKLOG
            task.state = state
            task.updated_at = _now()
            latest = sessions[0].state if sessions else None
            return {"task_id": task_id, "state": state.value, "bucket": bucket_for(state, latest)}

    async def done(self, task_id: str) -> dict[str, str]:
        result = await asyncio.to_thread(self._set_done, task_id, True)
        log_event("task_done", f"task {task_id} marked done", TASK_ID=task_id)
        return result

    async def reopen(self, task_id: str) -> dict[str, str]:
        result = await asyncio.to_thread(self._set_done, task_id, False)
        log_event("task_reopened", f"task {task_id} reopened ({result['state']})", TASK_ID=task_id)
        return result
