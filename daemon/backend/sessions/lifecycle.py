"""Finishing things: ``session_stop`` and ``session_logs`` (``api.LIFECYCLE_OPS``; ``task_done`` and
``task_reopen`` are ``daemon.backend.tasks.tasks``).

``session_stop`` (``kandev session stop SESSION``) ends a session's agent, at once: this backend
stops tracking it first (so the agent's exit is not read as a failure), then its control server
stops it (SIGTERM, a grace period, then SIGKILL to its whole process group, its sandbox included,
every tool process in it). A RUNNING session's turn ends with it, with stop reason ``stopped``, and
the transcript says so (a ``session_stopped`` entry). No ``session/cancel`` goes first: the agent's
SIGTERM and grace period are its chance to wind down, and a cancel would let its tools go (an
unsandboxed agent's orphans then belong to the host's init, where the stop cannot find them). The
session then waits for input with its transcript and resume token: ``kandev resume`` gives it an
agent again. A session without an agent, or one still starting, is refused.

``session_logs`` (``kandev logs SESSION``) reads the standard error file the control server keeps
for the session's current (or last) agent, ``<home>/logs/agents/<instance id>.stderr.log``: its
last lines, or what follows a byte offset (``-f``). The file is the agent's own output, so it is
opened without following a symlink and read in bounded pieces; the client decides how to print it.
With ``wait_s`` a read after an offset waits up to that long for the file to change (a look at its
size every ``LOG_WAIT_STEP_S``, on this host), so ``logs -f`` asks once per change or per
``wait_s``, not every half second: for a session on another host of a cluster each ask is a
request row in the shared database.

A graceful stop of the backend that stops agents (survival off, ``kandev down --agents``, and the
passthrough sessions always) records each of their sessions as stopped cleanly
(``record_clean_stop``): the inventory row no longer claims a live agent, an open turn ends
interrupted with why (``clean_stop_why``: e.g. ``the backend stopped and survival is off``), the
session waits for input. The next backend then has nothing to re-track for them
and reports how many there were as information (``take_clean_stops``), not as sessions it could
not re-track.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from daemon.backend.cluster.identity import ClusterIdentity
from daemon.backend.recovery.repair import repair_interrupted
from daemon.backend.sessions.sessions import get_session
from daemon.core.journal import log_event
from daemon.store import transcript, transitions
from daemon.store.db import Store
from daemon.store.models import ExecutorRunning, Task, TaskSession, Turn
from daemon.store.states import InventoryStatus, SessionState, TaskState, TurnState
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext as Backend

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]

STOPPED = "stopped"
"""The stop reason of a turn ``session stop`` ended."""
LOG_READ_BYTES = 256 * 1024  # at most this much of an agent's stderr per answer
DEFAULT_TAIL_LINES = 50
LOG_WAIT_MAX_S = 30  # the longest ``wait_s`` (a cluster request is answered within 55 s)
LOG_WAIT_STEP_S = 0.2  # how often a waiting read looks at the file's size
_INSTANCE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


async def stop_session(backend: Backend, session_id: str, *, by: str = "kandev session stop") -> dict[str, Any]:
    """Stop the session's agent and end its running turn (see the module doc); ``by``: who stopped
    it, as the transcript and the journal say (the turn watch stops an agent that ignored a cancel)."""
    with backend.store.session() as db:
        session = get_session(db, session_id)
        state, task_id = session.state, session.task_id
    ex = backend.executions.executions.get(session_id)
    if ex is None:
        raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no agent to stop (state {state})")
    if state not in (SessionState.WAITING_FOR_INPUT, SessionState.RUNNING):
        raise IpcError(ErrorCode.CONFLICT, f"session {session_id} is {state}: its agent is not started yet;"
                       " retry once it is")
    client = backend.servers.client_for(ex)
    if client is None:
        raise IpcError(ErrorCode.UNAVAILABLE, f"session {session_id}'s control server is not reachable;"
                       " retry shortly", True)
    # Untracked first: the agent's exit that follows is ours, not a failure of the session, and
    # nothing the agent says of its turn from now on reaches the store.
    await backend.executions.drop(lambda e: e.session_id == session_id, "session_stopped")
    try:
        await client.stop_instance(ex.instance_id)
    except IpcError as exc:
        raise IpcError(exc.code, f"session {session_id}: stopping its agent (pid {ex.agent.pid}) failed:"
                       f" {exc.message}; the next backend start settles it", exc.retryable) from None
    with backend.store.session() as db:
        row = db.get(ExecutorRunning, session_id)
        if row is not None:
            row.status = InventoryStatus.STALE  # the resume token is kept
        stopped = _end_running_turn(db, session_id, task_id, by)  # also one that began since the check above
        state = get_session(db, session_id).state
    log_event("session_agent_stopped", f"session {session_id}: agent stopped ({by})"
              + (f"; turn {stopped[0]} stopped with it" if stopped else ""),
              SESSION_ID=session_id, TASK_ID=task_id, INSTANCE_ID=ex.instance_id, AGENT_PID=ex.agent.pid)
    result: dict[str, Any] = {"session_id": session_id, "task_id": task_id, "instance_id": ex.instance_id,
                              "agent_pid": ex.agent.pid, "state": str(state)}
    if stopped:
        result["stopped_turn_id"] = stopped[0]
    return result


def _end_running_turn(db: Any, session_id: str, task_id: str, by: str) -> list[str]:
    """The open turn of a session whose agent ``session stop`` just stopped: ended ``stopped`` (a
    timed-out turn keeps ``timeout``), said in the transcript; the session waits for input, its task
    goes to review. Returns the turn ids."""
    now = datetime.now(UTC)
    ended = []
    for turn in db.scalars(select(Turn).where(Turn.session_id == session_id, Turn.state == TurnState.OPEN)):
        turn.state = TurnState.FINISHED
        turn.stop_reason = turn.stop_reason or STOPPED  # set while open: agents.turn_timeout_s (timeout)
        turn.ended_at = now
        ended.append(turn.id)
    if ended:
        transcript.append(db, session_id, role="system", kind="session_stopped", turn_id=ended[0],
                          text=f"Stopped by {by} while turn {ended[0]} was running: the turn and the"
                               f" agent were stopped. kandev resume {session_id} gives the session an agent again.",
                          created_at=now)
    with contextlib.suppress(transitions.TransitionConflict):
        transitions.transition_session(db, session_id, SessionState.WAITING_FOR_INPUT,
                                       expected_from={SessionState.RUNNING}, reason=f"stopped ({by})")
        task = db.get(Task, task_id)
        if task is not None and task.state != TaskState.DONE:
            transitions.set_task_state(db, task_id, TaskState.REVIEW)
    return ended


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


async def _until_changed(path: Path, offset: int, wait_s: float) -> None:
    """Until the log's size is no longer ``offset`` (it grew, or it was cut), ``wait_s`` at most."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while _size(path) == offset and loop.time() < deadline:
        await asyncio.sleep(min(LOG_WAIT_STEP_S, max(0.0, deadline - loop.time())))


def _read_log(path: Path, tail: int, offset: int | None) -> tuple[str, int, int]:
    """(text, offset after it, size) of the agent's stderr file; a file cut meanwhile (it is
    truncated when it grows too big) is read again from its start."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return "", 0, 0
    except OSError as exc:
        raise IpcError(ErrorCode.CONFLICT, f"the agent's log {path} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset is not None:
            start = offset if offset <= size else 0
            f.seek(start)
            data = f.read(LOG_READ_BYTES)
            return data.decode("utf-8", errors="replace"), start + len(data), size
        start = max(0, size - LOG_READ_BYTES)
        f.seek(start)
        data = f.read(LOG_READ_BYTES)
    lines = data.splitlines(keepends=True)
    if start > 0 and lines:
        lines = lines[1:]  # the first line read may be cut
    return b"".join(lines[-tail:]).decode("utf-8", errors="replace"), start + len(data), size


async def session_logs(backend: Backend, session_id: str, tail: int, offset: int | None,
                       wait_s: float = 0.0) -> dict[str, Any]:
    with backend.store.session() as db:
        get_session(db, session_id)
        row = db.get(ExecutorRunning, session_id)
        stored = row.instance_id if row is not None else None
    ex = backend.executions.executions.get(session_id)
    instance_id = ex.instance_id if ex is not None else stored
    if instance_id is None:
        raise IpcError(ErrorCode.NOT_FOUND, f"session {session_id} never had an agent: no log")
    if not _INSTANCE_ID.fullmatch(instance_id):
        raise IpcError(ErrorCode.CONFLICT, f"session {session_id}'s instance id is not a file name")
    path = backend.paths.logs_dir / "agents" / f"{instance_id}.stderr.log"
    if offset is not None and wait_s > 0:
        await _until_changed(path, offset, wait_s)
    text, end, size = await asyncio.to_thread(_read_log, path, tail, offset)
    return {"session_id": session_id, "instance_id": instance_id, "path": str(path), "text": text,
            "offset": end, "size": size, "live": ex is not None}


CLEAN_STOP = "backend_stopped"
SURVIVAL_OFF = "the backend stopped and survival is off"
AGENTS_ASKED = "the backend stopped with its agents (kandev down --agents)"


def clean_stop_why(*, survival: str, survival_reason: str | None, passthrough: bool, agents_asked: bool) -> str:
    """Why an agent stops with the backend, in words (its interrupted turn says it): ``survival``
    is the capability's state (enabled, disabled, unavailable)."""
    if passthrough and survival == "enabled":
        return "the backend stopped (a passthrough session's agent always stops with it)"
    if survival == "enabled" or agents_asked:
        return AGENTS_ASKED
    if survival == "unavailable":
        return f"the backend stopped and survival is unavailable here ({survival_reason or 'unknown reason'})"
    return SURVIVAL_OFF


def stopping_with_backend(backend: Backend) -> dict[str, str]:
    """The sessions whose agents a graceful stop of the backend now stops, each with why."""
    cap = backend.capability
    detach = backend.enabled and not backend.stop_agents_at_shutdown
    return {ex.session_id: clean_stop_why(survival=cap.state, survival_reason=cap.reason,
                                          passthrough=ex.passthrough, agents_asked=backend.stop_agents_at_shutdown)
            for ex in backend.executions.executions.values() if ex.passthrough or not detach}


def open_turns(store: Store, session_ids: list[str]) -> int:
    """How many of these sessions' turns are running (a stop now ends them)."""
    if not session_ids:
        return 0
    with store.session() as db:
        return int(db.scalar(select(func.count()).select_from(Turn).where(
            Turn.session_id.in_(session_ids), Turn.state == TurnState.OPEN)) or 0)


def record_clean_stop(store: Store, stopped: dict[str, str]) -> None:
    """The backend stops gracefully and these sessions' agents stop with it (session -> why).
    ``asked``: the user asked for the agents to stop (``kandev down --agents``), so the next start
    does not resume them by itself."""
    now = datetime.now(UTC)
    at = now.isoformat().replace("+00:00", "Z")
    with store.session() as db:
        for sid, why in stopped.items():
            repair_interrupted(db, sid, now, reason=f"agent stopped with the backend (kandev down): {why}",
                               interruption={"cause": CLEAN_STOP, "at": at, "reported": False, "why": why,
                                             "asked": why == AGENTS_ASKED},
                               turn_error=why)


def take_clean_stops(store: Store, identity: ClusterIdentity | None = None) -> list[str]:
    """The sessions the previous backend of this host recorded as stopped cleanly (each taken once)."""
    taken: list[str] = []
    own = (identity or ClusterIdentity()).own_sessions()
    with store.session() as db:
        for row in db.scalars(select(ExecutorRunning).join(TaskSession, TaskSession.id == ExecutorRunning.session_id)
                              .where(ExecutorRunning.status == InventoryStatus.STALE, own)):
            meta = dict(row.metadata_json or {})
            interruption = meta.get("interruption")
            if isinstance(interruption, dict) and interruption.get("cause") == CLEAN_STOP \
                    and interruption.get("reported") is False:
                meta["interruption"] = {**interruption, "reported": True}
                row.metadata_json = meta
                taken.append(row.session_id)
    return taken


def handlers(backend: Backend) -> dict[str, Handler]:
    async def op_session_stop(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await stop_session(backend, args["session_id"])

    async def op_session_logs(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        tail = int(args.get("tail", DEFAULT_TAIL_LINES))
        offset = args.get("offset")
        if not 1 <= tail <= 10_000:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"tail {tail} is not in 1..10000")
        if offset is not None and int(offset) < 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"offset {offset} is negative")
        wait_s = int(args.get("wait_s", 0))
        if not 0 <= wait_s <= LOG_WAIT_MAX_S:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"wait_s {wait_s} is not in 0..{LOG_WAIT_MAX_S}")
        return await session_logs(backend, args["session_id"], tail, None if offset is None else int(offset),
                                  wait_s)

    return {"session_stop": op_session_stop, "session_logs": op_session_logs}
