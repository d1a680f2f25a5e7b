"""Sessions: start one, prompt it, cancel its turn, answer its permission requests, show and list.

``SessionService`` is what the session ops (``daemon.backend.handlers.sessions``) and a workflow step's
automatic prompt (``daemon.backend.sessions.workflow_runner``) call. A start goes through the one launch
pipeline (``daemon.backend.sessions.launcher``): CREATED -> STARTING, credentials, create_instance,
inventory row, WAITING_FOR_INPUT; whatever fails after STARTING leaves the session FAILED with the
stage that failed in ``last_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from daemon.agentctl.protocol import NETWORK_CAPABILITY
from daemon.agents.registry import get_agent
from daemon.api.ops import BackendState
from daemon.backend.cluster.membership import READY
from daemon.backend.cluster.other_hosts import OtherHosts
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions import agent_launch
from daemon.backend.sessions.launcher import LaunchPlan, LaunchProgress, LaunchStage, SessionLauncher
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.executions import Execution
from daemon.backend.tasks.delete import refuse_while_deleting
from daemon.backend.views.session_view import PageRequest, StoredSession, permission_settled, read_session
from daemon.core.journal import log_event
from daemon.credentials import CredentialError
from daemon.store import transcript, transitions
from daemon.store.models import ExecutorRunning, Task, TaskSession, Turn
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import InventoryStatus, SessionState, TaskState, TurnState
from daemon.store.transcript import ensure_turn
from ipc.errors import ErrorCode, IpcError

NETWORK_STATUS_TIMEOUT_S = 2.0


def _now() -> datetime:
    return datetime.now(UTC)


def not_found(what: str, ident: str) -> IpcError:
    return IpcError(ErrorCode.NOT_FOUND, f"no {what} with id {ident!r}")


def get_task(db: Any, task_id: str) -> Task:
    task: Task | None = db.get(Task, task_id)
    if task is None:
        raise not_found("task", task_id)
    return task


def get_session(db: Any, session_id: str) -> TaskSession:
    session: TaskSession | None = db.get(TaskSession, session_id)
    if session is None:
        raise not_found("session", session_id)
    return session


class SessionService:
    def __init__(self, backend: BackendContext, launcher: SessionLauncher) -> None:
        self.backend = backend
        self.launcher = launcher

    def refuse_unless_ready(self) -> None:
        b = self.backend
        if b.state != BackendState.READY:
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {b.state}; retry shortly", True)

    async def start(self, task_id: str, agent_name: str, *, passthrough: bool,
                    prompt: str | None) -> dict[str, Any]:
        b = self.backend
        self.refuse_unless_ready()
        try:
            agent = get_agent(agent_name)
        except KeyError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc)) from None
        session_id = uuid.uuid4().hex
        with b.store.session() as db:
            task = get_task(db, task_id)
            task_id, workspace, executor = task.id, task.workspace, task.executor
            refuse_while_deleting(b.deleting_tasks, task_id, "no new session starts")
            db.add(
                TaskSession(
                    id=session_id,
                    task_id=task_id,
                    agent=agent_name,
                    state=SessionState.CREATED,
                    metadata_json=SessionMetadata.new().to_json(),
                    passthrough=passthrough,
                    host=b.cluster.identity.new_session_host(),
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
            db.flush()
            transitions.transition_session(db, session_id, SessionState.STARTING, expected_from={SessionState.CREATED}, reason="start")
        plan = LaunchPlan(session_id=session_id, task_id=task_id, agent=agent, agent_name=agent_name,
                          workspace=workspace or "", executor=executor, passthrough=passthrough)
        progress = LaunchProgress()
        try:
            # A GitHub-backed workspace gets its scoped lease now that STARTING is durable (as a resume does).
            launched = await self.launcher.launch(plan, progress)
        except BaseException as exc:
            # Whatever failed after STARTING, the session does not stay STARTING.
            stage = progress.stage
            await self.launcher.abandon(session_id, passthrough)
            error = exc.to_ipc() if isinstance(exc, CredentialError) else exc
            message = error.message if isinstance(error, IpcError) else (str(error) or type(error).__name__)
            with b.store.session() as db, contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, SessionState.FAILED, expected_from={SessionState.STARTING}, reason=f"start failed ({stage})",
                    last_error=f"{stage}: {message}",
                )
            if (stage == LaunchStage.LAUNCH and isinstance(error, IpcError)
                    and error.code != agent_launch.SANDBOX_UNAVAILABLE):
                raise IpcError(ErrorCode.AGENT_ERROR, f"agent failed to start: {message}") from None
            if error is not exc:
                raise error from None
            raise
        creds = launched.credentials
        assert creds is not None
        with b.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            meta.set_acp_session_id(launched.acp_session_id)
            meta.save(session)
            self.launcher.record_live(db, launched, last_event_seq=0)
            self.launcher.ready(db, session_id, task_id, "agent ready")
        ex = self.launcher.track(launched)
        log_event(
            "session_started",
            f"session {session_id} started: agent {agent_name} pid {ex.agent.pid}",
            SESSION_ID=session_id,
            TASK_ID=task_id,
            INSTANCE_ID=ex.instance_id,
            AGENT_PID=ex.agent.pid,
        )
        result: dict[str, Any] = {"session_id": session_id, "turn_id": None, "credential_policy": creds.policy}
        if prompt:
            started = await self.prompt(session_id, prompt, wait=False)
            result["turn_id"] = started["turn_id"]
        return result

    async def prompt(self, session_id: str, text: str, *, wait: bool) -> dict[str, Any]:
        b = self.backend
        b.executions.check_launch(session_id)
        ex = b.executions.executions.get(session_id)
        with b.store.session() as db:
            session = get_session(db, session_id)
            if ex is None:
                raise IpcError(
                    ErrorCode.CONFLICT, f"session {session_id} has no running agent (state {session.state})"
                )
            if session.state != SessionState.WAITING_FOR_INPUT:
                raise IpcError(ErrorCode.CONFLICT, f"session {session_id} is {session.state}; a turn is in progress")
            # its agent is about to be stopped (task delete --stop)
            refuse_while_deleting(b.deleting_tasks, session.task_id,
                                  f"session {session_id} takes no new turn")
            transitions.transition_session(
                db, session_id, SessionState.RUNNING, expected_from={SessionState.WAITING_FOR_INPUT}, reason="prompt"
            )
            transitions.set_task_state(db, session.task_id, TaskState.IN_PROGRESS)
        client = b.servers.client_for(ex)
        try:
            if client is None:
                raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
            turn_id = str(await client.prompt(ex.instance_id, text))
        except IpcError as exc:
            with b.store.session() as db:
                with contextlib.suppress(transitions.TransitionConflict):
                    transitions.transition_session(
                        db, session_id, SessionState.WAITING_FOR_INPUT, expected_from={SessionState.RUNNING}, reason="prompt refused",
                        last_error=exc.message,
                    )
                    transitions.set_task_state(db, ex.task_id, TaskState.REVIEW)
            raise
        waiter = ex.wait_turn(turn_id) if wait else None
        with b.store.session() as db:
            turn = ensure_turn(db, session_id, turn_id, text)
            finished = turn.state != TurnState.OPEN
            stop_reason = turn.stop_reason
        if not finished:  # its agent's silence counts from now (an ended turn's end was noted already)
            b.quiet.started(session_id, turn_id)
        result: dict[str, Any] = {"turn_id": turn_id}
        if waiter is not None:
            if finished:
                ex.resolve_turn(turn_id, stop_reason)
            result["stop_reason"] = await waiter
        return result

    async def cancel(self, session_id: str) -> dict[str, Any]:
        b = self.backend
        with b.store.session() as db:
            state = get_session(db, session_id).state
        ex = b.executions.executions.get(session_id)
        if ex is None:
            raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no running agent")
        if state != SessionState.RUNNING:  # nothing to cancel: say so rather than "sent"
            raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no running turn to cancel (it is {state})")
        client = b.servers.client_for(ex)
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
        await client.cancel(ex.instance_id)
        return {"ok": True}

    def _refuse_if_settled(self, session_id: str, request_id: Any) -> None:
        """A request answered (or cancelled) before: say so, with the answer and how long ago
        (Issue 46 Why 6), rather than that no such request is open."""
        with self.backend.store.session() as db:
            get_session(db, session_id)
            settled = permission_settled(db, session_id, str(request_id))
        if settled is None:
            return
        ago = max(0, round((datetime.now(UTC) - settled["at"]).total_seconds()))
        what = (f"answered ({settled['answer'] or 'cancelled'}, {ago} s ago)" if settled["state"] == "answered"
                else f"cancelled ({settled['reason'] or 'unanswered'}, {ago} s ago)")
        raise IpcError(ErrorCode.CONFLICT, f"permission request {str(request_id)[:8]} of session {session_id[:8]} was"
                       f" already {what}; nothing changed",
                       details={"state": settled["state"], "answer": settled["answer"], "seconds_ago": ago})

    async def respond_permission(self, session_id: str, request_id: Any, option_id: Any) -> dict[str, Any]:
        b = self.backend
        self._refuse_if_settled(session_id, request_id)
        ex = b.executions.executions.get(session_id)
        client = b.servers.client_for(ex) if ex is not None else None
        if ex is None or client is None:
            raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no running agent")
        try:
            await client.respond_permission(ex.instance_id, request_id, option_id)
        except IpcError as exc:
            if exc.code == ErrorCode.NOT_FOUND:  # answered meanwhile (by another caller), or cancelled
                self._refuse_if_settled(session_id, request_id)
            raise
        b.quiet.answered(session_id, str(request_id))  # the agent has the word again
        with b.store.session() as db:
            transcript.append(db, session_id, role="user", kind="permission_response",
                              text=json.dumps({"request_id": request_id, "option_id": option_id}, sort_keys=True))
        return {"ok": True}

    def _read_session(self, session_id: str, request: PageRequest) -> StoredSession:
        """The store's part of ``session show`` (a worker thread, its own store session)."""
        with self.backend.store.session() as db:
            stored = read_session(db, session_id, request)
        if stored is None:
            raise not_found("session", session_id)
        return stored

    async def show(self, session_id: str, request: PageRequest) -> dict[str, Any]:
        b = self.backend
        # Transcripts may be huge: read off the loop, one bounded page (daemon.backend.views.session_view).
        # The row's state and the tracked execution must be of one moment: a launch commits its
        # state and starts tracking in one step of the loop, which can fall during the read (then
        # "STARTING" and live would be shown together). If tracking changed meanwhile, read again.
        for _ in range(3):
            before = b.executions.executions.get(session_id)
            stored = await asyncio.to_thread(self._read_session, session_id, request)
            ex = b.executions.executions.get(session_id)
            if ex is before:
                break
        session, row = stored.session, stored.row
        # another host's session (Issue 47): live where its host is ready and its inventory row is live
        host_state, remote_live = await asyncio.to_thread(self._host_of, session.host, row)
        meta = SessionMetadata.load(session)
        runtime = meta.runtime_config_or_empty()
        return {
            "session_id": session.id,
            "task_id": session.task_id,
            "state": session.state,
            "agent": session.agent,
            "passthrough": bool(session.passthrough),
            **(ex.agent if ex else AgentIdentity.recorded(row) if row else AgentIdentity(None)).shown(),
            "instance_id": ex.instance_id if ex else (row.instance_id if row else None),
            "resume_token": row.resume_token if row else meta.acp_session_id,
            "retracked": bool(ex.retracked) if ex else False,
            "live": ex is not None or remote_live,
            # in a cluster: the host that drives it and that host's state (a single host's show keeps its shape)
            **({"host": session.host, "host_state": host_state,
                "on_this_host": session.host == b.cluster.identity.host} if session.host is not None else {}),
            # another host's session is resumed by its own host, not here
            "recoverable": ex is None and session.state not in (SessionState.COMPLETED,) and row is not None
            and host_state in (None, READY),
            "not_retracked_reason": b.report.not_retracked.get(session_id),
            # Why its agent was lost, while it has none: a backend restart or a lost control server.
            "interruption": (row.metadata_json or {}).get("interruption") if row is not None and ex is None else None,
            "guard": b.executions.guards.get(session_id),
            # its running turn's agent silent for agents.quiet_warning_s (daemon/backend/views/quiet_report.py)
            "quiet": b.quiet_report(session_id, session.agent),
            "last_error": session.last_error,
            "runtime_config": runtime,
            # the runtime job a first use ran before the agent started (daemon/backend/sessions/runtime_prepare.py)
            "runtime_prepare": meta.runtime_prepare,
            "network": await self._network(ex),
            "permissions": stored.permissions,
            "turns": stored.turns,
            "turns_total": stored.turns_total,
            "transcript": stored.transcript,
            "page": stored.page,
        }

    def _host_of(self, host: str | None, row: ExecutorRunning | None) -> tuple[str | None, bool]:
        """A session's host state (None on a single host) and, for another host's session, whether
        its agent lives there (its host ready and its inventory row live). A worker thread."""
        if host is None:  # a single host's session
            return None, False
        cluster = self.backend.cluster
        if not cluster.identity.enabled:
            return None, False
        if host == cluster.identity.host:
            return READY, False
        seen = cluster.directory.reachability(host)
        state = seen.state if seen is not None else "unknown"
        return state, state == READY and row is not None and row.status == InventoryStatus.LIVE

    def open_turns(self, session_ids: list[str]) -> dict[str, str]:
        """Session id -> its open turn, of these sessions (a worker thread)."""
        with self.backend.store.session() as db:
            return {sid: tid for sid, tid in db.execute(
                select(Turn.session_id, Turn.id).where(Turn.session_id.in_(session_ids), Turn.state == TurnState.OPEN)
            )}

    async def _network(self, ex: Execution | None) -> dict[str, Any] | None:
        """The live agent's network as its control server reports it (Issue 44): its mode, how many
        requests its egress proxy refused and the last few; None without a live agent or an answer."""
        client = self.backend.servers.client_for(ex) if ex is not None else None
        if ex is None or client is None or not client.usable or NETWORK_CAPABILITY not in client.capabilities:
            return None
        try:
            status: dict[str, Any] = await client.call("network_status", {"instance_id": ex.instance_id},
                                                       timeout=NETWORK_STATUS_TIMEOUT_S)
            return status
        except (IpcError, OSError, TimeoutError):
            return None

    def _read_sessions(self) -> tuple[list[tuple[str, str, str, str | None]], OtherHosts]:
        with self.backend.store.session() as db:
            rows = [(sid, task_id, state, host) for sid, task_id, state, host in db.execute(
                select(TaskSession.id, TaskSession.task_id, TaskSession.state, TaskSession.host)
                .order_by(TaskSession.created_at)
            )]
            return rows, OtherHosts.read(db, self.backend.cluster)

    async def list(self, *, detail: bool) -> dict[str, Any]:
        b = self.backend
        if detail:
            return await b.views.session_rows()
        rows, others = await asyncio.to_thread(self._read_sessions)  # off the loop: every session of the store
        executions = b.executions.executions
        # in a cluster each session also says its host and that host's state; a single host's keep their shape
        hosted = others.own is not None
        return {
            "sessions": [
                {
                    "session_id": sid,
                    "task_id": task_id,
                    "state": state,
                    "retracked": bool((ex := executions.get(sid)) is not None and ex.retracked),
                    **({"host": host, "host_state": others.host_state(host)} if hosted else {}),
                }
                for sid, task_id, state, host in rows
            ]
        }
