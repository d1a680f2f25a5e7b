"""Tasks: create one (with its workspace) and read the board.

A task's workspace is an existing absolute directory (``local`` with ``--workspace``), a fresh
directory under the home's worktrees (``local`` without one), or a git worktree of the given
repository on branch ``kandev/<task id>`` (``worktree``; created off the event loop).
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path

from daemon.backend.worktree import add_worktree
from daemon.journal import log_event
from daemon.paths import Paths
from daemon.store.board import board
from daemon.store.db import Store
from daemon.store.models import Task
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
        with self.store.session() as db:
            db.add(
                Task(
                    id=task_id,
                    title=title,
                    workspace=workspace,
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

    def _read_board(self) -> dict[str, list[str]]:
        with self.store.session() as db:
            return board(db)

    async def board(self) -> dict[str, list[str]]:
        return await asyncio.to_thread(self._read_board)  # off the loop: every task of the store
