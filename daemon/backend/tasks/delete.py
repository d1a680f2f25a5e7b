"""``task_delete``: remove a task, its sessions and what kandev keeps for them on disk.

Refused (``conflict``, nothing removed) while any of the task's sessions has an agent: one this
backend tracks, one being started, one the inventory still names as possibly running, or one
startup recovery holds; in a cluster, also while one belongs to another host (its directories
are on that host: the task is deleted from there). With ``stop`` (``kandev task delete --stop``) the agents this backend
tracks whose sessions are idle (WAITING_FOR_INPUT, no turn running) are stopped first (their
process groups killed by the control server); a turn still running is refused all the same
(``kandev cancel`` ends it). A session whose agent has exited can always be deleted. While a
deletion runs, the task's sessions can neither start, resume, reset their context nor take a new
prompt. Then, in this order:

1. each session's private directory ``<home>/sessions/<sid>/`` (the agent's HOME and state, its
   git lease, its credential endpoint; the endpoint is closed first);
2. the task's workspace, only if kandev created it, as its record says
   (``daemon.backend.git.workspace_record``): ``<home>/worktrees/<task id>`` and, for a git worktree,
   its administrative directory in the recorded repository, each checked against the record (a
   real directory at its resolved path, the recorded owner) and removed without running git and
   without following a symlink (``daemon.backend.git.worktree.remove_recorded``); nothing the agent
   wrote (its ``.git`` file, a ``gitdir`` or ``commondir``, a symlink) decides what goes. The branch
   ``kandev/<task id>`` is kept, since it may hold the agent's commits. A workspace the user named
   with ``--workspace`` is never touched. A task created before records existed: its directory
   under ``<home>/worktrees`` only (a worktree's admin entry is left for ``git worktree prune``);
3. the task's rows (its sessions, turns, transcripts, leases, workflow steps go with it).

Files go first, so a failure leaves the task in place for another try. Everything on disk runs off
the event loop.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from daemon.backend.git import workspace_record
from daemon.backend.git.workspace_record import RecordMismatch, WorkspaceRecord
from daemon.backend.git.worktree import remove_recorded, remove_unrecorded
from daemon.backend.state.executions import Execution
from daemon.core.journal import log_event
from daemon.host.session_dirs import SessionDirs
from daemon.store.models import ExecutorRunning, Task, TaskSession
from daemon.store.states import InventoryStatus, SessionState
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext as Backend

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]


def _live_reason(backend: Backend, sessions: list[TaskSession], rows: dict[str, ExecutorRunning],
                 stop: bool) -> str | None:
    """Why the task cannot go now (None: it can). With ``stop``, an idle tracked agent (its session
    WAITING_FOR_INPUT, no turn running) is no reason: it is stopped first."""
    for s in sessions:
        if not backend.cluster.identity.owns(s.host):  # Issue 47: its directories and agent are there
            return (f"session {s.id} belongs to cluster host {s.host}, which keeps its directories and drives"
                    " its agent: delete the task from that host")
        if s.id in backend.executions.executions:
            if not stop:
                return f"session {s.id} has a running agent (--stop stops idle agents first)"
            if s.state != SessionState.WAITING_FOR_INPUT:
                return f"session {s.id} is {s.state}: its agent is not idle (kandev cancel {s.id} ends its turn)"
            continue
        if s.state == SessionState.STARTING:
            return f"session {s.id} is starting its agent"
        row = rows.get(s.id)
        if row is not None and row.status == InventoryStatus.LIVE:
            return (f"session {s.id} may still have an agent this backend does not track (its inventory row is"
                    " live; settled at the next backend start)")
        if backend.executions.guards.get(s.id):
            return f"session {s.id} is held by startup recovery"
    return None


def refuse_while_deleting(deleting_tasks: set[str], task_id: str, refused: str) -> None:
    """A ``conflict`` if task ``task_id`` is being deleted: what would give one of its sessions an
    agent or a turn (``refused``: what is refused, e.g. "no new turn starts") calls this in the same
    stretch without an await as its own state change, as ``delete_task`` checks and claims."""
    if task_id in deleting_tasks:
        raise IpcError(ErrorCode.CONFLICT, f"task {task_id} is being deleted: {refused}")


async def delete_task(backend: Backend, task_id: str, *, stop: bool = False) -> dict[str, Any]:
    # The check and the claim run in one stretch without an await: from here on no session of the
    # task can start, resume, reset its context or take a prompt (each calls refuse_while_deleting).
    with backend.store.session() as db:
        task = db.get(Task, task_id)
        if task is None:
            raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
        if task_id in backend.deleting_tasks:
            raise IpcError(ErrorCode.CONFLICT, f"task {task_id} is already being deleted")
        sessions = list(db.scalars(select(TaskSession).where(TaskSession.task_id == task_id)))
        rows = {r.session_id: r for r in db.scalars(
            select(ExecutorRunning).where(ExecutorRunning.task_id == task_id))}
        why = _live_reason(backend, sessions, rows, stop)
        if why:
            raise IpcError(ErrorCode.CONFLICT, f"task {task_id} cannot be deleted: {why}; nothing was removed")
        workspace, executor = task.workspace, task.executor
        record = workspace_record.load(db, task_id)
        session_ids = [s.id for s in sessions]
    backend.deleting_tasks.add(task_id)
    try:
        stopped = await _stop_agents(backend, task_id, session_ids)
        return {**await _remove(backend, task_id, session_ids, workspace, executor, record), "stopped": stopped}
    finally:
        backend.deleting_tasks.discard(task_id)


async def _stop_agents(backend: Backend, task_id: str, session_ids: list[str]) -> list[str]:
    """Stop each tracked (idle) agent of the task: its process group is killed by its control
    server, then it is no longer tracked. A failure keeps the task (nothing is removed).

    Each stop takes up to the control server's grace, and the others wait meanwhile: no turn can
    start then (``prompt`` refuses a task being deleted), and each session is checked idle again
    right before its own stop, so a busy agent is never stopped by a deletion."""
    stopped: list[str] = []
    for sid in session_ids:
        ex = backend.executions.executions.get(sid)
        if ex is None:
            continue
        with backend.store.session() as db:
            session = db.get(TaskSession, sid)
            state = session.state if session is not None else None
        if state != SessionState.WAITING_FOR_INPUT:
            gone = f"; agents already stopped: {', '.join(stopped)}" if stopped else ""
            raise IpcError(ErrorCode.CONFLICT, f"task {task_id} was not deleted: session {sid} is {state},"
                           f" its agent no longer idle (kandev cancel {sid} ends its turn){gone}")
        client = backend.servers.client_for(ex)
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, f"task {task_id} was not deleted: session {sid}'s control"
                           " server is not reachable; retry shortly", True)
        try:
            await client.stop_instance(ex.instance_id)
        except IpcError as exc:
            raise IpcError(exc.code, f"task {task_id} was not deleted: stopping session {sid}'s agent failed:"
                           f" {exc.message}", exc.retryable) from None
        await backend.executions.drop(_session_is(sid), "task_deleted")
        with backend.store.session() as db:  # should the removal fail, a later try is not refused
            row = db.get(ExecutorRunning, sid)
            if row is not None:
                row.status = InventoryStatus.STALE
        stopped.append(sid)
        log_event("session_agent_stopped", f"session {sid}: agent stopped to delete task {task_id}",
                  SESSION_ID=sid, TASK_ID=task_id, INSTANCE_ID=ex.instance_id)
    return stopped


async def _remove(backend: Backend, task_id: str, session_ids: list[str], workspace: str | None,
                  executor: str | None, record: WorkspaceRecord | None) -> dict[str, Any]:
    removed: list[str] = []
    try:
        for sid in session_ids:
            await backend.endpoints.close(sid)  # its socket lives in the directory about to go
            root = SessionDirs.for_session(backend.paths.home, sid).root
            if await asyncio.to_thread(root.exists):
                await asyncio.to_thread(shutil.rmtree, root)
                removed.append(str(root))
        created = backend.paths.worktrees_dir / task_id
        worktree = "kept (not created by kandev)"
        if record is not None and record.created:
            removed += await asyncio.to_thread(remove_recorded, record)
            worktree = "removed" + (f"; its branch kandev/{task_id} is kept" if record.is_worktree else "")
        elif record is None and workspace and Path(workspace) == created:
            removed += await asyncio.to_thread(remove_unrecorded, created)
            worktree = "removed" + (f"; its branch kandev/{task_id} and the repository's entry for it are kept"
                                    " (git worktree prune clears the entry)" if executor == "worktree" else "")
    except RecordMismatch as exc:
        raise IpcError(ErrorCode.CONFLICT, f"task {task_id} was not deleted: {exc}, which is not what kandev"
                       f" recorded; already removed: {', '.join(removed) or 'nothing'}; the task and its"
                       " sessions are kept") from None
    except OSError as exc:
        raise IpcError(ErrorCode.INTERNAL, f"task {task_id} was not deleted: removing its files failed ({exc});"
                       f" already removed: {', '.join(removed) or 'nothing'}; the task and its sessions"
                       " are kept, try again") from None
    with backend.store.session() as db:
        task = db.get(Task, task_id)
        if task is not None:
            db.delete(task)  # sessions, turns, transcript, leases, inventory, steps: ON DELETE CASCADE
    log_event("task_deleted", f"task {task_id} deleted with {len(session_ids)} session(s); workspace {worktree}",
              TASK_ID=task_id, SESSIONS=len(session_ids))
    return {"task_id": task_id, "deleted": True, "sessions": session_ids, "workspace": workspace,
            "worktree": worktree, "removed": removed}


def handlers(backend: Backend) -> dict[str, Handler]:
    async def op_task_delete(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await delete_task(backend, args["task_id"], stop=bool(args.get("stop", False)))

    return {"task_delete": op_task_delete}


def _session_is(session_id: str) -> Callable[[Execution], bool]:
    return lambda ex: ex.session_id == session_id
