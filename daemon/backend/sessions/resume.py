"""Resume: a session that did not survive gets an agent again, by hand or automatically.

``session_resume`` (``kandev resume SID [--fresh]``): a session that did not survive (FAILED,
CANCELLED, or WAITING_FOR_INPUT without a live agent) gets an agent again. The provider
conversation continues through ACP ``session/load`` with the stored token; ``--fresh`` wipes
the token and starts a new one (``session/new``). Never a silent fallback to a fresh one.

**Resume** (RESUME-1, RESUME-2, RESUME-3, RESUME-4, RESUME-5, RESUME-6, RESUME-7, RESUME-8, RESUME-9), read ``ResumeService.resume`` top to bottom:

1. refused while recovery guards the session (``session_guarded``, retryable), while the backend is
   not ready, and for a session with a live agent (``conflict``);
2. under the per-session lock: STARTING through the guarded transition (the token is wiped here
   only for ``--fresh``) **before** the request is assembled (RESUME-5, RESUME-8);
3. assembly, through the one launch pipeline (``daemon.backend.sessions.launcher``): the agent
   command from the built-in registry, the workspace, and the git credentials
   (``daemon.credentials.prepare_git_credentials``; the broker issues a lease only now that
   STARTING is durable, RESUME-9), whose non-secret ``git_credential_snapshot`` is stored while
   still STARTING, before launch (RESUME-6);
4. launch: ``create_instance`` with ``resume_session_id`` = the token;
5. success: the provider's report is stored, the inventory row is live again, the execution is
   tracked and its events consumed (after the ``session/load`` replay, which repeats a transcript
   we already hold), WAITING_FOR_INPUT, task in review;
6. any failure after 2: the prior recoverable state again (unless a competing transition got there
   first, which is kept); never a STARTING left behind (RESUME-7). The tokens
   (``metadata.acp.session_id``, ``executors_running.resume_token``) are never touched by a failure:
   only ``--fresh`` wipes them and only a new provider session replaces them (RESUME-1, RESUME-2, RESUME-3, RESUME-4).

**Automatic resume** (RESUME-10), switched on by ``features.auto_resume`` (the default): once startup recovery
and reconciliation are done (backend ``ready``), every session that this start's reconciliation
repaired (interrupted by the restart: WAITING_FOR_INPUT, no live agent, a stale inventory row with
a token; re-tracked sessions and rows of unknown liveness are never touched), and every session
whose agent the previous backend stopped with itself at a graceful stop (survival off; not those
``kandev down --agents`` stopped on request), is resumed
in the background through the same path; meanwhile the board does not call them "no agent". So are the sessions a control server that died under the
running backend interrupted, once its replacement runs (``resume_interrupted``). While it runs the session is STARTING
(every session of the batch at once; at most ``AUTO_RESUME_PARALLEL`` launch at a time, the others wait their
turn STARTING, never WAITING_FOR_INPUT without an agent yet kept off needs_attention: Issue 45 scenario A), so its task keeps the
bucket of its own state (review: ``turn_finished``); it never shows in backlog or running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from daemon.agents.registry import get_agent
from daemon.api.ops import BackendState
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions import runtime_config as rc
from daemon.backend.sessions.launcher import Launched, LaunchPlan, SessionLauncher
from daemon.backend.sessions.live import LiveSessions, conflict, iso
from daemon.backend.sessions.sessions import get_session
from daemon.backend.tasks.delete import refuse_while_deleting
from daemon.core.journal import log_event
from daemon.credentials import CredentialError
from daemon.store import transitions
from daemon.store.models import ExecutorRunning, Task, TaskSession
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import InventoryStatus, SessionState
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.backend.resume")

RESUMABLE = (SessionState.WAITING_FOR_INPUT, SessionState.FAILED, SessionState.CANCELLED)
AUTO_RESUME_PARALLEL = 4


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
class ResumeService:
    backend: BackendContext
    launcher: SessionLauncher
    live: LiveSessions
    auto_task: asyncio.Task[None] | None = None
    later_tasks: set[asyncio.Task[None]] = field(default_factory=set)  # resumes after a control-server restart
    auto_resumed: dict[str, str] = field(default_factory=dict)  # session -> outcome

    async def resume(self, session_id: str, *, fresh: bool, automatic: bool = False,
                     launch_gate: asyncio.Semaphore | None = None) -> dict[str, Any]:
        """``launch_gate``: automatic resume's bound on launches at once; the session is STARTING
        while it waits for its turn (a queued resume is under way, not "no agent")."""
        b = self.backend
        # 1. recovery's guard first: retryable while it decides the session (AC-EXECUTORS-SURVIVAL-002.8)
        b.executions.check_launch(session_id)
        if b.state != BackendState.READY:
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {b.state}; retry shortly", True)
        with b.store.session() as db:
            get_session(db, session_id)
        self.live.refuse_live(session_id)
        async with self.live.lock(session_id):
            b.executions.check_launch(session_id)
            self.live.refuse_live(session_id)
            # 2. STARTING before anything is assembled (RESUME-5, RESUME-8)
            begun = self._begin(session_id, fresh=fresh, automatic=automatic)
            launched: Launched | None = None
            try:
                # 3. assembly and 4. launch: the one launch pipeline (it issues the credential lease
                # now that STARTING is durable)
                async with launch_gate or contextlib.nullcontext():
                    launched = await self.launcher.launch(self._plan(begun))
                # 5. success
                return await self._finish(begun, launched)
            except BaseException as exc:
                # 6. back to the prior recoverable state; the tokens are left as they are
                await self.launcher.abandon(session_id, begun.passthrough,
                                            launched.info.get("instance_id") if launched is not None else None)
                state = self._back_to_prior(begun, exc)
                if isinstance(exc, CredentialError):
                    exc = exc.to_ipc()
                elif isinstance(exc, transitions.TransitionError):
                    exc = conflict(f"the session changed meanwhile ({exc})")
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
            session = get_session(db, session_id)
            prior = session.state
            if prior not in RESUMABLE:
                raise conflict(
                    f"session {session_id} is {prior}; only FAILED, CANCELLED and WAITING_FOR_INPUT (without"
                    " a live agent) sessions can be resumed"
                )
            task = db.get(Task, session.task_id)
            if task is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"the task of session {session_id} is gone")
            refuse_while_deleting(b.deleting_tasks, task.id, f"session {session_id} does not resume")
            row = db.get(ExecutorRunning, session_id)
            if row is not None and row.status == InventoryStatus.LIVE:
                # The inventory still claims an agent this backend does not track (liveness unknown,
                # or another backend owns its server): a second agent for the session is refused.
                raise conflict(
                    f"session {session_id}: its inventory row still names a possibly running agent"
                    " (liveness unknown); it is settled at the next backend start"
                )
            meta = SessionMetadata.load(session)
            token = (row.resume_token if row is not None else None) or meta.acp_session_id
            if not fresh and not token:
                # Never a silent fallback to a fresh conversation.
                raise conflict(f"session {session_id} has no provider session to resume; --fresh starts a new one")
            if fresh:  # Start fresh: the one user action that wipes the token (RESUME-2)
                meta.set_acp_session_id(None)
                if row is not None:
                    row.resume_token = None
                token = None
            meta.set_resume(status="starting", at=iso(), fresh=fresh, automatic=automatic)
            try:
                transitions.transition_session(
                    db, session_id, SessionState.STARTING, expected_from={prior},
                    reason="resume (fresh)" if fresh else ("automatic resume" if automatic else "resume"),
                    metadata_json=meta.to_json(),
                )
            except transitions.TransitionConflict as exc:
                raise conflict(f"session {session_id} changed to {exc.current_state} meanwhile; retry", True) from None
            return _Begun(
                session_id=session_id, task_id=task.id, prior=prior, agent=session.agent,
                workspace=task.workspace or "", executor=task.executor, passthrough=bool(session.passthrough),
                token=token, fresh=fresh, automatic=automatic,
            )

    def _require_starting(self, session_id: str) -> None:
        with self.backend.store.session() as db:
            state = get_session(db, session_id).state
        if state != SessionState.STARTING:
            raise conflict(f"session {session_id} is {state}, no longer STARTING: the resume stops here")

    def _plan(self, begun: _Begun) -> LaunchPlan:
        try:
            agent = get_agent(begun.agent)
        except KeyError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc)) from None
        if not begun.workspace or not os.path.isdir(begun.workspace):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the workspace {begun.workspace!r} no longer exists")
        # The broker refuses terminal sessions (RESUME-9): it is asked only once STARTING is durable.
        self._require_starting(begun.session_id)
        return LaunchPlan(session_id=begun.session_id, task_id=begun.task_id, agent=agent, agent_name=begun.agent,
                          workspace=begun.workspace, executor=begun.executor, passthrough=begun.passthrough,
                          resume_token=begun.token)

    async def _finish(self, begun: _Begun, launched: Launched) -> dict[str, Any]:
        b = self.backend
        sid = begun.session_id
        info = launched.info
        assert launched.credentials is not None
        credential_policy = launched.credentials.policy
        acp_id = info.get("acp_session_id")
        if not acp_id or (begun.token and acp_id != begun.token):
            raise IpcError(ErrorCode.AGENT_ERROR, f"the agent answered provider session {acp_id!r}, not {begun.token!r}")
        catalogue = rc.Catalogue.from_json(info)
        handshake_seq = launched.handshake_seq
        with b.store.session() as db:
            session = get_session(db, sid)
            meta = SessionMetadata.load(session)
            # The token names the conversation the agent now holds: the same one after a load, the
            # new one after a fresh start (RESUME-2: replaced only once the agent created it).
            meta.set_acp_session_id(acp_id)
            current = self.live.reported_over(meta.runtime_config, catalogue)
            meta.set_runtime_config(current.to_json())
            meta.set_acp_catalogue(catalogue.to_json())
            meta.set_resume(status="succeeded", at=iso(), fresh=begun.fresh, automatic=begun.automatic,
                            loaded=begun.token is not None, credential_policy=credential_policy)
            self.launcher.record_live(db, launched, last_event_seq=handshake_seq)
            # A competing transition that won is kept: the conflict propagates, the launch is undone.
            self.launcher.ready(
                db, sid, begun.task_id,
                "agent ready (" + ("fresh provider session" if begun.fresh else "resumed") + ")",
                metadata_json=meta.to_json(), last_error=None,
            )
            self.live.message(db, sid, "session_resumed", {
                "acp_session_id": acp_id, "loaded": begun.token is not None, "fresh": begun.fresh,
                "automatic": begun.automatic})
        ex = self.launcher.track(launched, last_seq=handshake_seq)
        self.live.catalogues[sid] = catalogue
        self.live.configs[sid] = current
        log_event(
            "session_resumed",
            f"session {sid} resumed: agent {begun.agent} pid {ex.agent.pid}, provider session {acp_id}"
            + (" (new)" if begun.fresh else " (session/load)"),
            SESSION_ID=sid, TASK_ID=begun.task_id, INSTANCE_ID=ex.instance_id, AGENT_PID=ex.agent.pid,
            FRESH=int(begun.fresh), AUTOMATIC=int(begun.automatic),
        )
        return {"session_id": sid, "state": SessionState.WAITING_FOR_INPUT, "acp_session_id": acp_id, "resume_token": acp_id,
                "loaded": begun.token is not None, "fresh": begun.fresh, "instance_id": ex.instance_id,
                "agent_pid": ex.agent.pid, "runtime_config": current.to_json(),
                "credential_policy": credential_policy}

    def _back_to_prior(self, begun: _Begun, exc: BaseException) -> str:
        """RESUME-7: the recoverable state the session had, unless a competing transition won."""
        reason = exc.message if isinstance(exc, IpcError | CredentialError) else (str(exc) or type(exc).__name__)
        with self.backend.store.session() as db:
            session = get_session(db, begun.session_id)
            meta = SessionMetadata.load(session)
            meta.set_resume(status="failed", at=iso(), fresh=begun.fresh, automatic=begun.automatic,
                            error=reason[:2000])
            try:
                transitions.transition_session(
                    db, begun.session_id, begun.prior, expected_from={SessionState.STARTING},
                    reason=f"resume failed: {reason[:200]}", last_error=f"resume failed: {reason[:2000]}",
                    metadata_json=meta.to_json(),
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
        while b.state in (BackendState.STARTING, BackendState.RECOVERING):
            await asyncio.sleep(0.05)
        if b.state != BackendState.READY:
            return
        await self._resume_all(self.interrupted_sessions(), "the restart")

    def resume_interrupted(self, session_ids: list[str]) -> None:
        """With ``features.auto_resume``: resume, in the background and through the same path, the
        sessions a lost control server interrupted, now that a new one runs (Issue 11)."""
        if not getattr(self.backend.config.features, "auto_resume", False) or self.backend.state != BackendState.READY:
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

        self.backend.auto_resume_pending.update(candidates)

        async def one(session_id: str) -> None:
            # Every candidate is STARTING at once (truthful: its resume is under way); at most
            # AUTO_RESUME_PARALLEL launch at a time (Issue 45 scenario A: a queued session left
            # WAITING_FOR_INPUT without an agent looked like "no agent" yet was not on the board).
            try:
                await self.resume(session_id, fresh=False, automatic=True, launch_gate=gate)
                self.auto_resumed[session_id] = "resumed"
            except IpcError as exc:
                self.auto_resumed[session_id] = exc.code
                log_event("auto_resume_failed", f"automatic resume of session {session_id}: {exc.message}",
                          priority=4, SESSION_ID=session_id, REASON=exc.code)
            except Exception:
                self.auto_resumed[session_id] = "internal"
                log.exception("automatic resume of session %s failed", session_id)
            finally:
                self.backend.auto_resume_pending.discard(session_id)

        await asyncio.gather(*(one(s) for s in candidates))

    def interrupted_sessions(self, named: list[str] | None = None) -> list[str]:
        """Sessions this start's reconciliation repaired (or ``named``: those a lost control server
        interrupted): not re-tracked, liveness not unknown, now WAITING_FOR_INPUT with a stale row
        holding a token, no agent, no guard."""
        b = self.backend
        report = b.report
        if named is None:  # what this start repaired, and what the previous backend stopped with itself
            named = [s for s in report.not_retracked if s not in set(report.unknown) and s not in report.retracked]
            named += report.stopped_with_backend
        out: list[str] = []
        with b.store.session() as db:
            for sid in sorted(named):
                session = db.get(TaskSession, sid)
                row = db.get(ExecutorRunning, sid)
                if session is None or row is None or session.state != SessionState.WAITING_FOR_INPUT:
                    continue
                if not b.cluster.identity.owns(session.host):
                    continue  # another host's session: its own backend resumes it
                if row.status != InventoryStatus.STALE or not row.resume_token:
                    continue
                if ((row.metadata_json or {}).get("interruption") or {}).get("asked"):
                    continue  # kandev down --agents: its user stopped that agent on purpose
                if sid in b.executions.executions or sid in b.executions.guards:
                    continue
                out.append(sid)
        return out
