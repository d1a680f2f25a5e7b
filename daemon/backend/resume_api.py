"""Resume, runtime configuration, context reset and workflow steps: the backend's ops.

The rules: docs/requirements.md#resume-and-runtime-recovery and
docs/requirements.md#runtime-configuration-across-a-context-reset.

Ops (``api.RESUME_OPS``; CLI in brackets):

- ``session_resume`` (``kandev resume SID [--fresh]``): a session that did not survive (FAILED,
  CANCELLED, or WAITING_FOR_INPUT without a live agent) gets an agent again. The provider
  conversation continues through ACP ``session/load`` with the stored token; ``--fresh`` wipes
  the token and starts a new one (``session/new``). Never a silent fallback to a fresh one.
- ``session_configure`` (``kandev session configure SID --model M --mode X --option ID=V``).
- ``session_reset_context`` (``kandev session reset-context SID [--restart]``).
- ``workflow_set``, ``task_workflow``, ``task_proceed`` (``kandev task create --steps``,
  ``kandev task workflow TASK_ID``, ``kandev task proceed TASK_ID``).

**Resume** (RESUME-1, RESUME-2, RESUME-3, RESUME-4, RESUME-5, RESUME-6, RESUME-7, RESUME-8, RESUME-9), read ``ResumeService.resume`` top to bottom:

1. refused while recovery guards the session (``session_guarded``, retryable), while the backend is
   not ready, and for a session with a live agent (``conflict``);
2. under the per-session lock: STARTING through the guarded transition (the token is wiped here
   only for ``--fresh``) **before** the request is assembled (RESUME-5, RESUME-8);
3. assembly: the agent command from the built-in registry, the workspace, and the git
   credentials (``daemon.credentials.prepare_git_credentials``; the broker issues a lease only now
   that STARTING is durable, RESUME-9), whose non-secret ``git_credential_snapshot`` is stored while
   still STARTING, before launch (RESUME-6);
4. launch: ``create_instance`` with ``resume_session_id`` = the token;
5. success: the provider's report is stored, the inventory row is live again, the execution is
   tracked and its events consumed (after the ``session/load`` replay, which repeats a transcript
   we already hold), WAITING_FOR_INPUT, task in review;
6. any failure after 2: the prior recoverable state again (unless a competing transition got there
   first, which is kept); never a STARTING left behind (RESUME-7). The tokens
   (``metadata.acp.session_id``, ``executors_running.resume_token``) are never touched by a failure:
   only ``--fresh`` wipes them and only a new provider session replaces them (RESUME-1, RESUME-2, RESUME-3, RESUME-4).

**Automatic resume** (RESUME-10), switched on by ``features.auto_resume``: once startup recovery
and reconciliation are done (backend ``ready``), every session that this start's reconciliation
repaired (interrupted by the restart: WAITING_FOR_INPUT, no live agent, a stale inventory row with
a token; re-tracked sessions and rows of unknown liveness are never touched) is resumed in the
background through the same path. So are the sessions a control server that died under the
running backend interrupted, once its replacement runs (``resume_interrupted``). While it runs the session is STARTING, so its task keeps the
bucket of its own state (review: ``turn_finished``); it never shows in backlog or running.

**Context reset** (RESETCFG-1, RESETCFG-2, RESETCFG-3, RESETCFG-4, RESETCFG-5, RESETCFG-6, RESETCFG-7, RESETCFG-8, RESETCFG-9, RESETCFG-10, RESETCFG-11, RESETCFG-12, RESETCFG-13): capture one ``SessionRuntimeConfig`` (before anything else),
STARTING, a new provider session (ACP fast path: ``reset_context`` = ``session/new`` on the same
process; fallback, also for a control server without the op: the process restarted with
``session/new``), the tokens replaced by the new session's id (RESUME-2), its reported defaults
stored (truthful), then the shared restore (model, mode, options by id) from the **captured**
value, never from the store, which by then holds the new session's announced defaults. Success:
WAITING_FOR_INPUT ("agent ready") and a ``context_reset`` transcript entry. A rejected field: the
accepted state is stored, the reset-failure status persisted in ``metadata.context_reset``, the
session FAILED, the agent stopped (resume continues the new provider session), and no ready or
reset event (RESETCFG-9, RESETCFG-10); a workflow step's automatic prompt is then not sent (RESETCFG-11).

Runtime state is written only from answers the agent accepted or from the events it sends
(RESETCFG-8); before writing, the backend waits until its event consumer has applied every event
the agent sent before its answer, so a late event cannot overwrite a newer accepted value.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from daemon.agents.registry import get_agent
from daemon.backend import agent_launch, runtime_prepare
from daemon.backend import runtime_config as rc
from daemon.backend import workflow as wf
from daemon.backend.executions import Execution
from daemon.credentials import CredentialError
from daemon.credentials.broker import POLICY_GITHUB_LEASE, SNAPSHOT_KEY
from daemon.journal import log_event
from daemon.store import transitions
from daemon.store.models import ExecutorRunning, Message, Task, TaskSession
from ipc.aio import cancel_and_wait
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext

if TYPE_CHECKING:
    from daemon.agentctl.client import AgentctlClient
    from daemon.backend.app import Backend

log = logging.getLogger("kandev.backend.resume")

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]

RESUMABLE = ("WAITING_FOR_INPUT", "FAILED", "CANCELLED")
CONVERGE_TIMEOUT_S = 5.0
AUTO_RESUME_PARALLEL = 4


def _now() -> datetime:
    return datetime.now(UTC)


def _put_runtime(meta: dict[str, Any], value: rc.SessionRuntimeConfig, catalogue: rc.Catalogue) -> None:
    """Store a session's runtime configuration in its metadata, and the agent's catalogue if known."""
    meta["runtime_config"] = value.to_json()
    if catalogue.known:
        meta["acp_catalogue"] = catalogue.to_json()


def _iso() -> str:
    return _now().isoformat().replace("+00:00", "Z")


def _conflict(message: str, retryable: bool = False) -> IpcError:
    return IpcError(ErrorCode.CONFLICT, message, retryable)


def handlers(backend: Backend) -> dict[str, Handler]:
    """The op handlers; also arms automatic resume (it waits for the end of startup recovery)."""
    service = ResumeService(backend)
    service.arm_auto_resume()
    backend.resume_service = service  # the backend asks it to resume what a lost control server interrupted
    return service.handlers()


@dataclass
class _Begun:
    """A resume that has moved its session to STARTING."""

    session_id: str
    task_id: str
    prior: str
    agent: str
    workspace: str
    executor: str
    passthrough: bool
    token: str | None  # None: fresh
    fresh: bool
    automatic: bool


@dataclass
class _Request:
    command: list[str]
    env: dict[str, str]
    snapshot: dict[str, Any] | None = None
    credential_policy: str | None = None
    sandbox: dict[str, Any] | None = None  # the wire form of daemon.agentctl.sandbox.SandboxRequest
    secret_env: dict[str, str] | None = None  # the agent's secrets by reference (daemon.agents.settings)


class _InstanceAgent:
    """``runtime_config.Agent`` bound to one control-server instance."""

    def __init__(self, client: AgentctlClient, instance_id: str) -> None:
        self.client = client
        self.instance_id = instance_id

    async def set_mode(self, mode_id: str) -> Mapping[str, Any]:
        return await self.client.set_mode(self.instance_id, mode_id)

    async def set_config_option(self, config_id: str, value: rc.OptionValue) -> Mapping[str, Any]:
        return await self.client.set_config_option(self.instance_id, config_id, value)


@dataclass
class ResumeService:
    backend: Backend
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    task_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # The live caches of this backend lifetime (RESETCFG-2): what the agent accepted or reported.
    live: dict[str, rc.SessionRuntimeConfig] = field(default_factory=dict)
    catalogues: dict[str, rc.Catalogue] = field(default_factory=dict)
    auto_task: asyncio.Task[None] | None = None
    later_tasks: set[asyncio.Task[None]] = field(default_factory=set)  # resumes after a control-server restart
    auto_resumed: dict[str, str] = field(default_factory=dict)  # session -> outcome

    def handlers(self) -> dict[str, Handler]:
        return {
            "session_resume": self.op_session_resume,
            "session_configure": self.op_session_configure,
            "session_reset_context": self.op_session_reset_context,
            "workflow_set": self.op_workflow_set,
            "task_workflow": self.op_task_workflow,
            "task_proceed": self.op_task_proceed,
        }

    # ------------------------------------------------------------------ helpers
    def _lock(self, session_id: str) -> asyncio.Lock:
        return self.locks.setdefault(session_id, asyncio.Lock())

    def _session(self, db: Any, session_id: str) -> TaskSession:
        session = db.get(TaskSession, session_id)
        if session is None:
            raise IpcError(ErrorCode.NOT_FOUND, f"no session with id {session_id!r}")
        return session

    def _refuse_live(self, session_id: str) -> None:
        if session_id in self.backend.executions.executions:
            raise _conflict(f"session {session_id} already has a live agent; resume is for sessions without one")

    def _live_execution(self, session_id: str) -> Execution:
        ex = self.backend.executions.executions.get(session_id)
        if ex is None or ex.gone:
            raise _conflict(f"session {session_id} has no running agent (resume it first: kandev resume)")
        return ex

    def _client(self, ex: Execution) -> AgentctlClient:
        client = self.backend._client_for(ex)
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
        return client

    async def _converge(self, ex: Execution, seq: int) -> None:
        """Wait (bounded) until the event consumer applied every event up to ``seq``."""
        if seq <= 0:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + CONVERGE_TIMEOUT_S
        while ex.last_seq < seq and not ex.gone and loop.time() < end:
            await asyncio.sleep(0.02)

    async def _untrack(self, ex: Execution) -> None:
        """Stop consuming this execution's events and forget it (its instance is not stopped here)."""
        ex.gone = True
        self.backend.executions.executions.pop(ex.session_id, None)
        consumer = ex.consumer
        if consumer is not None and consumer is not asyncio.current_task() and not await cancel_and_wait(consumer):
            log.error("session %s: the event consumer did not stop within 5 s of being cancelled", ex.session_id)
        ex.fail_waiters("agent_exited")

    async def _catalogue(self, session_id: str, meta: Mapping[str, Any]) -> rc.Catalogue:
        """What the agent last reported about its session: this lifetime's cache, else the control
        server's live record of the instance, else what the store kept."""
        cat = self.catalogues.get(session_id)
        if cat is not None and cat.known:
            return cat
        ex = self.backend.executions.executions.get(session_id)
        if ex is not None:
            with contextlib.suppress(IpcError):
                for inst in await self._client(ex).list_instances():
                    if inst.get("instance_id") == ex.instance_id and (inst.get("config_options") or inst.get("modes")):
                        cat = rc.Catalogue.from_json(inst)
                        self.catalogues[session_id] = cat
                        return cat
        return rc.Catalogue.from_json(meta.get("acp_catalogue"))

    @staticmethod
    def _reported_over(stored: Any, catalogue: rc.Catalogue) -> rc.SessionRuntimeConfig:
        """The stored value with what the agent reports as current winning (RESETCFG-12)."""
        old = rc.SessionRuntimeConfig.from_json(stored, catalogue)
        if not catalogue.known:
            return old
        new = rc.provider_state(catalogue)
        return rc.SessionRuntimeConfig(
            model=new.model if new.model is not None else old.model,
            mode=new.mode if new.mode is not None else old.mode,
            options=dict(new.options) if catalogue.config_options else dict(old.options),
        )

    def _message(self, db: Any, session_id: str, kind: str, payload: Mapping[str, Any]) -> None:
        db.add(Message(session_id=session_id, turn_id=None, role="system", kind=kind,
                       text=json.dumps(dict(payload), sort_keys=True, default=str), created_at=_now()))

    # ------------------------------------------------------------------ resume
    async def op_session_resume(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await self.resume(args["session_id"], fresh=bool(args.get("fresh", False)))

    async def resume(self, session_id: str, *, fresh: bool, automatic: bool = False) -> dict[str, Any]:
        b = self.backend
        # 1. recovery's guard first: retryable while it decides the session (AC-EXECUTORS-SURVIVAL-002.8)
        b.executions.check_launch(session_id)
        if b.state != "ready":
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {b.state}; retry shortly", True)
        with b.store.session() as db:
            self._session(db, session_id)
        self._refuse_live(session_id)
        async with self._lock(session_id):
            b.executions.check_launch(session_id)
            self._refuse_live(session_id)
            # 2. STARTING before anything is assembled (RESUME-5, RESUME-8)
            begun = self._begin(session_id, fresh=fresh, automatic=automatic)
            info: dict[str, Any] | None = None
            try:
                # 3. assembly (issues the credential lease now that STARTING is durable)
                request = await self._assemble(begun)
                # 4. launch
                info = await self._launch(begun, request)
                # 5. success
                return await self._finish(begun, request, info)
            except BaseException as exc:
                # 6. back to the prior recoverable state; the tokens are left as they are
                if info is not None:
                    await self._stop_quietly(begun.passthrough, info.get("instance_id"))
                self.backend.endpoints.close_soon(session_id)
                state = self._back_to_prior(begun, exc)
                if isinstance(exc, CredentialError):
                    exc = exc.to_ipc()
                elif isinstance(exc, transitions.TransitionError):
                    exc = _conflict(f"the session changed meanwhile ({exc})")
                if isinstance(exc, IpcError):
                    log_event("session_resume_failed", f"resume of session {session_id} failed: {exc.message}",
                              priority=4, SESSION_ID=session_id, TASK_ID=begun.task_id, REASON=exc.code)
                    raise IpcError(
                        exc.code,
                        f"resume failed: {exc.message}; the session is {state} again and keeps its resume token",
                        exc.retryable,
                    ) from None
                raise

    def _begin(self, session_id: str, *, fresh: bool, automatic: bool) -> _Begun:
        b = self.backend
        with b.store.session() as db:
            session = self._session(db, session_id)
            prior = session.state
            if prior not in RESUMABLE:
                raise _conflict(
                    f"session {session_id} is {prior}; only FAILED, CANCELLED and WAITING_FOR_INPUT (without"
                    " a live agent) sessions can be resumed"
                )
            task = db.get(Task, session.task_id)
            if task is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"the task of session {session_id} is gone")
            if task.id in b.deleting_tasks:
                raise _conflict(f"the task of session {session_id} is being deleted")
            row = db.get(ExecutorRunning, session_id)
            if row is not None and row.status == "live":
                # The inventory still claims an agent this backend does not track (liveness unknown,
                # or another backend owns its server): a second agent for the session is refused.
                raise _conflict(
                    f"session {session_id}: its inventory row still names a possibly running agent"
                    " (liveness unknown); it is settled at the next backend start"
                )
            meta = dict(session.metadata_json or {})
            token = (row.resume_token if row is not None else None) or (meta.get("acp") or {}).get("session_id")
            if not fresh and not token:
                # Never a silent fallback to a fresh conversation.
                raise _conflict(f"session {session_id} has no provider session to resume; --fresh starts a new one")
            if fresh:  # Start fresh: the one user action that wipes the token (RESUME-2)
                meta["acp"] = {**(meta.get("acp") or {}), "session_id": None}
                if row is not None:
                    row.resume_token = None
                token = None
            meta["resume"] = {"status": "starting", "at": _iso(), "fresh": fresh, "automatic": automatic}
            try:
                transitions.transition_session(
                    db, session_id, "STARTING", expected_from={prior},
                    reason="resume (fresh)" if fresh else ("automatic resume" if automatic else "resume"),
                    metadata_json=meta,
                )
            except transitions.TransitionConflict as exc:
                raise _conflict(f"session {session_id} changed to {exc.current_state} meanwhile; retry", True) from None
            return _Begun(
                session_id=session_id, task_id=task.id, prior=prior, agent=session.agent,
                workspace=task.workspace or "", executor=task.executor, passthrough=bool(session.passthrough),
                token=token, fresh=fresh, automatic=automatic,
            )

    def _require_starting(self, session_id: str) -> None:
        with self.backend.store.session() as db:
            state = self._session(db, session_id).state
        if state != "STARTING":
            raise _conflict(f"session {session_id} is {state}, no longer STARTING: the resume stops here")

    async def _assemble(self, begun: _Begun) -> _Request:
        try:
            agent = get_agent(begun.agent)
        except KeyError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc)) from None
        if not begun.workspace or not os.path.isdir(begun.workspace):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the workspace {begun.workspace!r} no longer exists")
        # The broker refuses terminal sessions (RESUME-9): it is asked only once STARTING is durable.
        self._require_starting(begun.session_id)
        await runtime_prepare.ensure(self.backend, agent, begun.session_id)  # first use: prepare the runtime
        command = await agent_launch.agent_command(self.backend, agent)
        prep = await agent_launch.prepare(self.backend, begun.session_id, command)
        assert prep.credentials is not None
        return _Request(command=prep.command, env=prep.env, snapshot=prep.credentials.snapshot,
                        credential_policy=prep.credentials.policy, sandbox=prep.sandbox,
                        secret_env=prep.secret_env)

    async def _launch(self, begun: _Begun, request: _Request) -> dict[str, Any]:
        b = self.backend
        async with b.launch_gate.launch():  # the server is not replaced under a launch
            client = await b._server_for(begun.passthrough)
            handle = b.passthrough_handle if begun.passthrough else b.handle
            info = await client.create_instance(
                session_id=begun.session_id, task_id=begun.task_id, command=request.command,
                cwd=begun.workspace, env=request.env, agent=begun.agent, resume_session_id=begun.token,
                sandbox=request.sandbox, secret_env=request.secret_env,
            )
        info = dict(info)
        info["endpoint"] = handle.endpoint if handle is not None else ""
        return info

    async def _stop_quietly(self, passthrough: bool, instance_id: str | None) -> None:
        if not instance_id:
            return
        b = self.backend
        client = b.passthrough_client if passthrough else b.client
        if client is not None:
            with contextlib.suppress(Exception):
                await client.stop_instance(instance_id)

    async def _finish(self, begun: _Begun, request: _Request, info: dict[str, Any]) -> dict[str, Any]:
        b = self.backend
        sid = begun.session_id
        acp_id = info.get("acp_session_id")
        if not acp_id or (begun.token and acp_id != begun.token):
            raise IpcError(ErrorCode.AGENT_ERROR, f"the agent answered provider session {acp_id!r}, not {begun.token!r}")
        catalogue = rc.Catalogue.from_json(info)
        handshake_seq = int(info.get("handshake_seq") or 0)
        with b.store.session() as db:
            session = self._session(db, sid)
            meta = dict(session.metadata_json or {})
            # The token names the conversation the agent now holds: the same one after a load, the
            # new one after a fresh start (RESUME-2: replaced only once the agent created it).
            meta["acp"] = {**(meta.get("acp") or {}), "session_id": acp_id}
            current = self._reported_over(meta.get("runtime_config"), catalogue)
            meta["runtime_config"] = current.to_json()
            meta["acp_catalogue"] = catalogue.to_json()
            meta["resume"] = {"status": "succeeded", "at": _iso(), "fresh": begun.fresh,
                              "automatic": begun.automatic, "loaded": begun.token is not None,
                              "credential_policy": request.credential_policy}
            db.merge(ExecutorRunning(
                session_id=sid, task_id=begun.task_id, instance_id=info["instance_id"],
                endpoint=info.get("endpoint") or "", agent_pid=info.get("pid"),
                agent_pid_start_time=info.get("pid_start_time"), resume_token=acp_id,
                worktree_path=begun.workspace if begun.executor == "worktree" else None,
                workspace_path=begun.workspace, runtime="standalone", agent_profile=begun.agent, status="live",
                last_event_seq=handshake_seq, created_by_boot=b.boot_id, metadata_json={},
                created_at=_now(), updated_at=_now(),
            ))
            # A competing transition that won is kept: the conflict propagates, the launch is undone.
            transitions.transition_session(
                db, sid, "WAITING_FOR_INPUT", expected_from={"STARTING"},
                reason="agent ready (" + ("fresh provider session" if begun.fresh else "resumed") + ")",
                metadata_json=meta, last_error=None,
            )
            transitions.set_task_state(db, begun.task_id, "review")
            self._message(db, sid, "session_resumed", {
                "acp_session_id": acp_id, "loaded": begun.token is not None, "fresh": begun.fresh,
                "automatic": begun.automatic})
        ex = Execution(
            session_id=sid, task_id=begun.task_id, instance_id=info["instance_id"], agent_pid=info.get("pid"),
            agent_pid_start_time=info.get("pid_start_time"), acp_session_id=acp_id,
            passthrough=begun.passthrough, last_seq=handshake_seq,
        )
        b.executions.executions[sid] = ex
        b.consumer.start(ex)
        self.catalogues[sid] = catalogue
        self.live[sid] = current
        log_event(
            "session_resumed",
            f"session {sid} resumed: agent {begun.agent} pid {ex.agent_pid}, provider session {acp_id}"
            + (" (new)" if begun.fresh else " (session/load)"),
            SESSION_ID=sid, TASK_ID=begun.task_id, INSTANCE_ID=ex.instance_id, AGENT_PID=ex.agent_pid,
            FRESH=int(begun.fresh), AUTOMATIC=int(begun.automatic),
        )
        return {"session_id": sid, "state": "WAITING_FOR_INPUT", "acp_session_id": acp_id, "resume_token": acp_id,
                "loaded": begun.token is not None, "fresh": begun.fresh, "instance_id": ex.instance_id,
                "agent_pid": ex.agent_pid, "runtime_config": current.to_json(),
                "credential_policy": request.credential_policy}

    def _back_to_prior(self, begun: _Begun, exc: BaseException) -> str:
        """RESUME-7: the recoverable state the session had, unless a competing transition won."""
        reason = exc.message if isinstance(exc, IpcError | CredentialError) else (str(exc) or type(exc).__name__)
        with self.backend.store.session() as db:
            session = self._session(db, begun.session_id)
            meta = dict(session.metadata_json or {})
            meta["resume"] = {"status": "failed", "at": _iso(), "fresh": begun.fresh, "automatic": begun.automatic,
                              "error": reason[:2000]}
            try:
                transitions.transition_session(
                    db, begun.session_id, begun.prior, expected_from={"STARTING"},
                    reason=f"resume failed: {reason[:200]}", last_error=f"resume failed: {reason[:2000]}",
                    metadata_json=meta,
                )
                return begun.prior
            except transitions.TransitionConflict as conflict:
                return conflict.current_state

    # --------------------------------------------------------------- automatic
    def arm_auto_resume(self) -> None:
        if not getattr(self.backend.config.features, "auto_resume", False):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.auto_task = loop.create_task(self._auto_resume(), name="auto-resume")

    async def _auto_resume(self) -> None:
        b = self.backend
        while b.state in ("starting", "recovering"):
            await asyncio.sleep(0.05)
        if b.state != "ready":
            return
        await self._resume_all(self.interrupted_sessions(), "the restart")

    def resume_interrupted(self, session_ids: list[str]) -> None:
        """With ``features.auto_resume``: resume, in the background and through the same path, the
        sessions a lost control server interrupted, now that a new one runs (Issue 11)."""
        if not getattr(self.backend.config.features, "auto_resume", False) or self.backend.state != "ready":
            return
        task = asyncio.get_running_loop().create_task(
            self._resume_all(self.interrupted_sessions(session_ids), "the loss of the control server"),
            name="auto-resume-after-loss")
        self.later_tasks.add(task)
        task.add_done_callback(self.later_tasks.discard)

    async def _resume_all(self, candidates: list[str], cause: str) -> None:
        if not candidates:
            return
        log_event("auto_resume", f"automatic resume of {len(candidates)} session(s) interrupted by {cause}",
                  COUNT=len(candidates))
        gate = asyncio.Semaphore(AUTO_RESUME_PARALLEL)

        async def one(session_id: str) -> None:
            async with gate:
                try:
                    await self.resume(session_id, fresh=False, automatic=True)
                    self.auto_resumed[session_id] = "resumed"
                except IpcError as exc:
                    self.auto_resumed[session_id] = exc.code
                    log_event("auto_resume_failed", f"automatic resume of session {session_id}: {exc.message}",
                              priority=4, SESSION_ID=session_id, REASON=exc.code)
                except Exception:
                    self.auto_resumed[session_id] = "internal"
                    log.exception("automatic resume of session %s failed", session_id)

        await asyncio.gather(*(one(s) for s in candidates))

    def interrupted_sessions(self, named: list[str] | None = None) -> list[str]:
        """Sessions this start's reconciliation repaired (or ``named``: those a lost control server
        interrupted): not re-tracked, liveness not unknown, now WAITING_FOR_INPUT with a stale row
        holding a token, no agent, no guard."""
        b = self.backend
        report = b.report
        if named is None:
            named = [s for s in report.not_retracked if s not in set(report.unknown) and s not in report.retracked]
        out: list[str] = []
        with b.store.session() as db:
            for sid in sorted(named):
                session = db.get(TaskSession, sid)
                row = db.get(ExecutorRunning, sid)
                if session is None or row is None or session.state != "WAITING_FOR_INPUT":
                    continue
                if row.status != "stale" or not row.resume_token:
                    continue
                if sid in b.executions.executions or sid in b.executions.guards:
                    continue
                out.append(sid)
        return out

    # ---------------------------------------------------------------- configure
    async def op_session_configure(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        options = args.get("options") or {}
        for key, value in options.items():
            if not isinstance(key, str) or not isinstance(value, (str, bool)):
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "options must map option ids to strings or booleans")
        return await self.configure(args["session_id"], args.get("model"), args.get("mode"), options)

    async def configure(self, session_id: str, model: str | None, mode: str | None,
                        options: Mapping[str, rc.OptionValue]) -> dict[str, Any]:
        b = self.backend
        b.executions.check_launch(session_id)
        async with self._lock(session_id):
            ex = self._live_execution(session_id)
            with b.store.session() as db:
                session = self._session(db, session_id)
                if session.state not in ("WAITING_FOR_INPUT", "RUNNING"):
                    raise _conflict(f"session {session_id} is {session.state}")
                meta = dict(session.metadata_json or {})
            catalogue = await self._catalogue(session_id, meta)
            for option_id in options:
                if catalogue.carries_model_or_mode(option_id):
                    raise IpcError(ErrorCode.INVALID_ARGUMENT,
                                   f"option {option_id!r} is the model or the mode: use --model / --mode")
            target = rc.normalize(model, mode, options, catalogue)
            if target.empty:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "nothing to configure: give --model, --mode or --option")
            base = self._reported_over(meta.get("runtime_config"), catalogue)
            agent = _InstanceAgent(self._client(ex), ex.instance_id)
            try:
                applied = await rc.apply_config(target, agent, catalogue, base)
            except rc.ApplyRejected as rej:
                await self._converge(ex, rej.last_seq)
                self._store_runtime(session_id, rej.accepted, rej.catalogue)
                raise IpcError(ErrorCode.AGENT_ERROR,
                               f"{rej}; accepted so far: {json.dumps(rej.accepted.to_json(), sort_keys=True)}",
                               False) from None
            await self._converge(ex, applied.last_seq)
            self._store_runtime(session_id, applied.accepted, applied.catalogue)
            log_event("session_configured", f"session {session_id} runtime configuration: "
                      f"{json.dumps(applied.accepted.to_json(), sort_keys=True)}", SESSION_ID=session_id)
            return {"session_id": session_id, "runtime_config": applied.accepted.to_json(),
                    "calls": [list(c) for c in applied.calls]}

    def _store_runtime(self, session_id: str, value: rc.SessionRuntimeConfig, catalogue: rc.Catalogue,
                       **extra: Any) -> None:
        with self.backend.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            _put_runtime(meta, value, catalogue)
            meta.update(extra)
            session.metadata_json = meta
        self.live[session_id] = value
        if catalogue.known:
            self.catalogues[session_id] = catalogue

    # ------------------------------------------------------------- reset context
    async def op_session_reset_context(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await self.reset_context(args["session_id"], restart=bool(args.get("restart", False)))

    async def capture(self, session_id: str) -> rc.SessionRuntimeConfig:
        """RESETCFG-1, RESETCFG-2, RESETCFG-3: profile, then persisted provider state, then the live caches; deep-copied."""
        with self.backend.store.session() as db:
            meta = dict(self._session(db, session_id).metadata_json or {})
        catalogue = await self._catalogue(session_id, meta)
        live = self.live.get(session_id) or (rc.provider_state(catalogue) if catalogue.known else None)
        profile = None  # the built-in agent profiles define no model, mode or options of their own
        return rc.capture(profile, meta.get("runtime_config"), live, catalogue)

    async def reset_context(self, session_id: str, *, restart: bool = False,
                            origin: str = "reset-context") -> dict[str, Any]:
        b = self.backend
        b.executions.check_launch(session_id)
        async with self._lock(session_id):
            ex = self._live_execution(session_id)
            with b.store.session() as db:
                state = self._session(db, session_id).state
            if state != "WAITING_FOR_INPUT":
                raise _conflict(f"session {session_id} is {state}; a context reset needs WAITING_FOR_INPUT")
            # RESETCFG-1, RESETCFG-5: one snapshot, before any new provider session exists
            snapshot = await self.capture(session_id)
            with b.store.session() as db:
                session = self._session(db, session_id)
                meta = dict(session.metadata_json or {})
                meta["context_reset"] = {"status": "resetting", "at": _iso(), "origin": origin,
                                         "captured": snapshot.to_json()}
                transitions.transition_session(db, session_id, "STARTING", expected_from={"WAITING_FOR_INPUT"},
                                               reason=f"context reset ({origin})", metadata_json=meta)
            try:
                ex, info, path = await self._new_provider_session(ex, restart)
            except BaseException as exc:
                self._reset_not_started(session_id, exc)
                if isinstance(exc, IpcError):
                    raise IpcError(exc.code, f"context reset failed before a new provider session existed:"
                                   f" {exc.message}", exc.retryable) from None
                raise
            catalogue = self._record_new_session(session_id, ex, info, path)
            client = self._client(ex)
            try:
                applied = await rc.restore(snapshot, _InstanceAgent(client, ex.instance_id), catalogue)
            except rc.ApplyRejected as rej:
                await self._reset_failed(session_id, ex, snapshot, rej, path)
                raise IpcError(ErrorCode.AGENT_ERROR,
                               f"context reset failed: {rej}; the session is FAILED (kandev resume continues the"
                               " new provider session)", False) from None
            except BaseException as exc:
                await self._reset_failed(session_id, ex, snapshot, exc, path)
                raise
            await self._converge(ex, applied.last_seq)
            return self._reset_succeeded(session_id, ex, snapshot, applied, path, origin)

    async def _new_provider_session(self, ex: Execution, restart: bool) -> tuple[Execution, dict[str, Any], str]:
        client = self._client(ex)
        if not restart:
            try:
                info = dict(await client.reset_context(ex.instance_id))
                ex.acp_session_id = info.get("acp_session_id")
                return ex, info, "acp"
            except IpcError as exc:
                if exc.code != ErrorCode.UNKNOWN_OP:
                    raise
                log.info("control server has no reset_context: context reset by process restart")
        # Fallback: the agent process restarted, with a new provider session (session/new).
        sid = ex.session_id
        with self.backend.store.session() as db:
            session = self._session(db, sid)
            task = db.get(Task, session.task_id)
            meta = dict(session.metadata_json or {})
            agent_name, passthrough = session.agent, bool(session.passthrough)
            workspace = task.workspace if task is not None else None
        if not workspace or not os.path.isdir(workspace):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the workspace {workspace!r} no longer exists")
        snapshot = meta.get(SNAPSHOT_KEY) or {}
        # Credentials are untouched by a reset (RESETCFG-13): the same lease file, the same routing,
        # the same sandbox.
        prep = await agent_launch.prepare_relaunch(self.backend, sid, get_agent(agent_name),
                                                   with_lease=snapshot.get("policy") == POLICY_GITHUB_LEASE)
        with contextlib.suppress(IpcError):
            for inst in await client.list_instances():
                if inst.get("instance_id") == ex.instance_id:
                    await self._converge(ex, int(inst.get("next_seq") or 1) - 1)
        await self._untrack(ex)
        async with self.backend.launch_gate.launch():  # no replacement of the server between the two
            client.check_sandbox(prep.sandbox)  # refused before the agent is stopped, not after
            client.check_secret_env(prep.secret_env)
            await client.stop_instance(ex.instance_id)
            info = dict(await client.create_instance(
                session_id=sid, task_id=ex.task_id, command=prep.command, cwd=workspace,
                env=prep.env, agent=agent_name, sandbox=prep.sandbox, secret_env=prep.secret_env,
            ))
        handle = self.backend.passthrough_handle if passthrough else self.backend.handle
        info["endpoint"] = handle.endpoint if handle is not None else ""
        new = Execution(
            session_id=sid, task_id=ex.task_id, instance_id=info["instance_id"], agent_pid=info.get("pid"),
            agent_pid_start_time=info.get("pid_start_time"), acp_session_id=info.get("acp_session_id"),
            passthrough=passthrough, last_seq=int(info.get("handshake_seq") or 0),
        )
        self.backend.executions.executions[sid] = new
        self.backend.consumer.start(new)
        return new, info, "restart"

    def _reset_not_started(self, session_id: str, exc: BaseException) -> None:
        """No new provider session: the old conversation stays; back to WAITING_FOR_INPUT (tokens kept)."""
        reason = exc.message if isinstance(exc, IpcError) else (str(exc) or type(exc).__name__)
        live = session_id in self.backend.executions.executions
        with self.backend.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            meta["context_reset"] = {**(meta.get("context_reset") or {}), "status": "failed", "at": _iso(),
                                     "stage": "new_session", "error": reason[:2000]}
            if not live:
                row = db.get(ExecutorRunning, session_id)
                if row is not None:
                    row.status = "stale"
                    row.updated_at = _now()
            with contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, "WAITING_FOR_INPUT", expected_from={"STARTING"},
                    reason=f"context reset failed: {reason[:200]}", last_error=f"context reset failed: {reason[:2000]}",
                    metadata_json=meta,
                )

    def _record_new_session(self, session_id: str, ex: Execution, info: dict[str, Any], path: str) -> rc.Catalogue:
        """A new provider session exists: both tokens now name it (RESUME-2, RESUME-3), and what it reports
        as current (its defaults) is stored truthfully (RESETCFG-12); restore does not read it."""
        catalogue = rc.Catalogue.from_json(info)
        acp_id = info["acp_session_id"]
        with self.backend.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            meta["acp"] = {**(meta.get("acp") or {}), "session_id": acp_id}
            meta["runtime_config"] = self._reported_over(None, catalogue).to_json()
            meta["acp_catalogue"] = catalogue.to_json()
            meta["context_reset"] = {**(meta.get("context_reset") or {}), "status": "restoring", "path": path,
                                     "acp_session_id": acp_id}
            session.metadata_json = meta
            row = db.get(ExecutorRunning, session_id)
            if row is not None:
                row.resume_token = acp_id
                if path == "restart":
                    row.instance_id = info["instance_id"]
                    row.agent_pid = info.get("pid")
                    row.agent_pid_start_time = info.get("pid_start_time")
                    row.endpoint = info.get("endpoint") or row.endpoint
                    row.last_event_seq = int(info.get("handshake_seq") or 0)
                    row.created_by_boot = self.backend.boot_id
                    row.status = "live"
                row.updated_at = _now()
        self.catalogues[session_id] = catalogue
        self.live.pop(session_id, None)  # the old session's cache says nothing about the new one
        return catalogue

    async def _reset_failed(self, session_id: str, ex: Execution, snapshot: rc.SessionRuntimeConfig,
                            failure: BaseException, path: str) -> None:
        """RESETCFG-9, RESETCFG-10, RESETCFG-11: the accepted state stored truthfully, the failure status persisted, the
        execution failed (agent stopped), no ready and no reset event."""
        if isinstance(failure, rc.ApplyRejected):
            await self._converge(ex, failure.last_seq)
            accepted, catalogue, error = failure.accepted, failure.catalogue, str(failure)
            fld = failure.field
        else:
            accepted, catalogue = self.live.get(session_id) or rc.SessionRuntimeConfig(), rc.Catalogue()
            error = failure.message if isinstance(failure, IpcError) else (str(failure) or type(failure).__name__)
            fld = None
        with self.backend.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            _put_runtime(meta, accepted, catalogue)
            meta["context_reset"] = {
                **(meta.get("context_reset") or {}), "status": "failed", "at": _iso(), "path": path,
                "stage": "restore", "field": fld, "error": error[:2000], "captured": snapshot.to_json(),
                "accepted": accepted.to_json(),
            }
            row = db.get(ExecutorRunning, session_id)
            if row is not None:
                row.status = "stale"  # the token (the new provider session) is kept for a resume
                row.updated_at = _now()
            with contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, "FAILED", expected_from={"STARTING"},
                    reason=f"context reset failed: {error[:200]}", last_error=f"context reset failed: {error[:2000]}",
                    metadata_json=meta,
                )
            self._message(db, session_id, "context_reset_failed", {"error": error[:2000], "field": fld,
                                                                   "accepted": accepted.to_json()})
        self.live[session_id] = accepted
        await self._untrack(ex)
        with contextlib.suppress(Exception):
            await self._client(ex).stop_instance(ex.instance_id)
        log_event("context_reset_failed", f"session {session_id}: context reset failed: {error}", priority=3,
                  SESSION_ID=session_id, TASK_ID=ex.task_id, INSTANCE_ID=ex.instance_id, REASON=fld or "error")

    def _reset_succeeded(self, session_id: str, ex: Execution, snapshot: rc.SessionRuntimeConfig,
                         applied: rc.Applied, path: str, origin: str) -> dict[str, Any]:
        value = applied.accepted
        with self.backend.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            _put_runtime(meta, value, applied.catalogue)
            meta["context_reset"] = {
                **(meta.get("context_reset") or {}), "status": "succeeded", "at": _iso(), "path": path,
                "origin": origin, "acp_session_id": ex.acp_session_id, "runtime_config": value.to_json(),
            }
            # The new session is announced ready only now that restore succeeded (RESETCFG-10).
            transitions.transition_session(db, session_id, "WAITING_FOR_INPUT", expected_from={"STARTING"},
                                           reason="agent ready (context reset)", metadata_json=meta,
                                           last_error=None)
            self._message(db, session_id, "context_reset", {
                "acp_session_id": ex.acp_session_id, "path": path, "origin": origin,
                "runtime_config": value.to_json()})
        self.live[session_id] = value
        self.catalogues[session_id] = applied.catalogue
        log_event("context_reset", f"session {session_id}: context reset ({path}), provider session"
                  f" {ex.acp_session_id}, runtime configuration restored", SESSION_ID=session_id,
                  TASK_ID=ex.task_id, INSTANCE_ID=ex.instance_id, PATH=path)
        return {"session_id": session_id, "state": "WAITING_FOR_INPUT", "path": path,
                "acp_session_id": ex.acp_session_id, "resume_token": ex.acp_session_id,
                "runtime_config": value.to_json(), "captured": snapshot.to_json(),
                "calls": [list(c) for c in applied.calls]}

    # ------------------------------------------------------------------ workflow
    def _task_lock(self, task_id: str) -> asyncio.Lock:
        return self.task_locks.setdefault(task_id, asyncio.Lock())

    async def op_workflow_set(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        task_id = args["task_id"]
        try:
            steps = wf.parse_steps(args["steps"])
        except wf.WorkflowError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        async with self._task_lock(task_id):
            with self.backend.store.session() as db:
                if db.get(Task, task_id) is None:
                    raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
                try:
                    wf.set_steps(db, task_id, steps)
                except wf.WorkflowError as exc:
                    raise _conflict(str(exc)) from None
                return {"task_id": task_id, "steps": wf.describe(wf.load_steps(db, task_id))}

    async def op_task_workflow(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        task_id = args["task_id"]
        with self.backend.store.session() as db:
            if db.get(Task, task_id) is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"no task with id {task_id!r}")
            steps = wf.load_steps(db, task_id)
            here = wf.current(steps)
            return {"task_id": task_id, "current": here.name if here else None, "steps": wf.describe(steps)}

    async def op_task_proceed(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await self.proceed(args["task_id"])

    def _latest_session(self, db: Any, task_id: str) -> TaskSession | None:
        return db.scalars(select(TaskSession).where(TaskSession.task_id == task_id)
                          .order_by(TaskSession.created_at.desc(), TaskSession.id.desc()).limit(1)).first()

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
                    raise _conflict(str(exc)) from None
                needs_agent = bool(target.reset_context or target.prompt)
                latest = self._latest_session(db, task_id)
                session_id = latest.id if latest is not None else None
                if needs_agent:
                    ex = b.executions.executions.get(session_id) if session_id else None
                    if latest is None or ex is None or latest.state != "WAITING_FOR_INPUT":
                        raise _conflict(
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
                    result["reset"] = await self.reset_context(session_id, origin=f"workflow step {name}")
                except IpcError as exc:
                    detail = f"context reset failed: {exc.message}; the automatic prompt was not sent"
                    self._step_status(task_id, position, "blocked", detail)
                    log_event("workflow_step_blocked", f"task {task_id} step {name!r}: {detail}", priority=4,
                              TASK_ID=task_id, SESSION_ID=session_id, STEP=name)
                    raise IpcError(exc.code, f"entered step {name!r}, but {detail}", exc.retryable) from None
            if prompt:
                assert session_id is not None
                try:
                    started = await b._prompt(session_id, prompt, wait=False)
                except IpcError as exc:
                    detail = f"the automatic prompt was refused: {exc.message}"
                    self._step_status(task_id, position, "blocked", detail)
                    raise IpcError(exc.code, f"entered step {name!r}, but {detail}", exc.retryable) from None
                result["prompt"] = {"sent": True, "turn_id": started["turn_id"], "text": prompt}
            self._step_status(task_id, position, "active", "entered")
            log_event("workflow_step_entered", f"task {task_id} entered step {name!r}", TASK_ID=task_id, STEP=name)
            return result
