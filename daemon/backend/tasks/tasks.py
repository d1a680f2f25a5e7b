"""Tasks: create one (with its workspace), mark one done (``kandev task done``) and take it back
(``kandev task reopen``).

A done task is in the board's done bucket whatever its sessions say, until a new prompt (which puts
it in progress again) or ``reopen``. It is refused while a session of the task runs a turn or starts
an agent: the turn's end would put the task back in review at once.

A task's workspace is an existing absolute directory (``local`` with ``--workspace``), a fresh
directory under the home's worktrees (``local`` without one), or a git worktree of the given
repository on branch ``kandev/<task id>`` (``worktree``; created off the event loop, checked out
in a sandbox: ``daemon.backend.git.worktree``). Its host paths are recorded with the task, in the same
transaction (``daemon.backend.git.workspace_record``): every later removal, bind or git acts on the
record, never on what the workspace says.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import select

from daemon.agentctl.sandbox.bubblewrap import SandboxPolicy, find_bwrap
from daemon.backend.git.workspace_record import WorkspaceRecord, record_local
from daemon.backend.git.worktree import CheckoutSandbox, check_shared, create_worktree, locate_repository
from daemon.config.settings import Config
from daemon.core.journal import log_event
from daemon.credentials.scope import workspace_origin_url
from daemon.host.agent_user import check_workspace as check_agent_can_write
from daemon.host.agent_user import give
from daemon.host.paths import Paths
from daemon.store.board import bucket_for
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession
from daemon.store.states import TaskState
from ipc.errors import ErrorCode, IpcError

EXECUTORS = ("local", "worktree")


def _now() -> datetime:
    return datetime.now(UTC)


class TaskService:
    def __init__(self, store: Store, paths: Paths, config: Callable[[], Config],
                 hidden: Callable[[], list[str]]) -> None:
        self.store = store
        self.paths = paths
        self.config = config  # the current configuration (it may be reloaded)
        self.hidden = hidden  # what no agent's sandbox shows (daemon.backend.sessions.agent_launch.hidden_paths)

    async def create(self, title: str, executor: str, workspace: str | None) -> dict[str, str]:
        title = title.strip()
        if not title:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "title must not be empty")
        if executor not in EXECUTORS:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"executor must be one of {', '.join(EXECUTORS)}")
        task_id = uuid.uuid4().hex
        record = await self._workspace_for(task_id, workspace, executor)
        # As given (or where kandev made it); the record holds it resolved.
        given = str(self.paths.worktrees_dir / task_id) if record.created else (workspace or record.path)
        # Recorded now, before any agent runs in it: the repository its sessions' git may reach.
        git_remote = await asyncio.to_thread(workspace_origin_url, given)
        with self.store.session() as db:
            db.add(
                Task(
                    id=task_id,
                    title=title,
                    workspace=given,
                    git_remote=git_remote,
                    executor=executor,
                    state=TaskState.BACKLOG,
                    interrupted=False,
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
            db.flush()  # the task row first: the record refers to it
            db.add(record.row(task_id))
        log_event("task_created", f"task {task_id} created", TASK_ID=task_id)
        return {"task_id": task_id, "workspace": given}

    async def _workspace_for(self, task_id: str, workspace: str | None, executor: str) -> WorkspaceRecord:
        if executor == "worktree":
            if not workspace:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "executor 'worktree' needs --workspace (a git repository)")
            repo = await asyncio.to_thread(locate_repository, workspace)
            # the agent commits into the repository's git directory: its uid must be able to write it
            await asyncio.to_thread(check_shared, repo)
            return await create_worktree(repo, self.paths.worktrees_dir / task_id, f"kandev/{task_id}",
                                         self._checkout_sandbox())
        if workspace:
            path = Path(workspace)
            if not path.is_absolute() or not path.is_dir():
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"workspace {workspace!r} is not an existing absolute directory")
            await asyncio.to_thread(check_agent_can_write, path)  # a user's directory is never re-owned
            return await asyncio.to_thread(record_local, workspace, created=False)
        target = self.paths.worktrees_dir / task_id
        await asyncio.to_thread(target.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(give, target)  # kandev made it: the agent's
        return await asyncio.to_thread(record_local, str(target), created=True)

    def _checkout_sandbox(self) -> CheckoutSandbox:
        return CheckoutSandbox(SandboxPolicy(self.config().agents.sandbox), tuple(self.hidden()), find_bwrap())

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

