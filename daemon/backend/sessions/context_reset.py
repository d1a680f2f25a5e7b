"""Context reset: ``session_reset_context`` (``kandev session reset-context SID [--restart]``)
and a workflow step that resets context (RESETCFG-1, RESETCFG-2, RESETCFG-3, RESETCFG-4, RESETCFG-5, RESETCFG-6, RESETCFG-7, RESETCFG-8, RESETCFG-9, RESETCFG-10, RESETCFG-11, RESETCFG-12, RESETCFG-13).

Capture one ``SessionRuntimeConfig`` (before anything else), STARTING, a new provider session (ACP
fast path: ``reset_context`` = ``session/new`` on the same process; fallback, also for a control
server without the op: the agent process restarted with ``session/new`` through the one launch
pipeline, ``daemon.backend.sessions.launcher``), the tokens replaced by the new session's id
(RESUME-2), its reported defaults stored (truthful), then the shared restore (model, mode, options
by id) from the **captured** value, never from the store, which by then holds the new session's
announced defaults. Success: WAITING_FOR_INPUT ("agent ready") and a ``context_reset`` transcript
entry. A rejected field: the accepted state is stored, the reset-failure status persisted in
``metadata.context_reset``, the session FAILED, the agent stopped (resume continues the new
provider session), and no ready or reset event (RESETCFG-9, RESETCFG-10); a workflow step's automatic prompt
is then not sent (RESETCFG-11).
"""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import UTC, datetime
from typing import Any

from daemon.agents.registry import get_agent
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions import runtime_config as rc
from daemon.backend.sessions.launcher import Launched, LaunchPlan, SessionLauncher
from daemon.backend.sessions.live import InstanceAgent, LiveSessions, conflict, iso, put_runtime
from daemon.backend.sessions.sessions import get_session
from daemon.backend.state.executions import Execution
from daemon.backend.tasks.delete import refuse_while_deleting
from daemon.core.journal import log_event
from daemon.credentials.broker import POLICY_GITHUB_LEASE
from daemon.store import transitions
from daemon.store.models import ExecutorRunning, Task
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import SessionState
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.backend.resume")


def _now() -> datetime:
    return datetime.now(UTC)


class ContextReset:
    def __init__(self, backend: BackendContext, launcher: SessionLauncher, live: LiveSessions) -> None:
        self.backend = backend
        self.launcher = launcher
        self.live = live

    async def capture(self, session_id: str) -> rc.SessionRuntimeConfig:
        """RESETCFG-1, RESETCFG-2, RESETCFG-3: profile, then persisted provider state, then the live caches; deep-copied."""
        with self.backend.store.session() as db:
            meta = SessionMetadata.load(get_session(db, session_id))
        catalogue = await self.live.catalogue(session_id, meta)
        live = self.live.configs.get(session_id) or (rc.provider_state(catalogue) if catalogue.known else None)
        profile = None  # the built-in agent profiles define no model, mode or options of their own
        return rc.capture(profile, meta.runtime_config, live, catalogue)

    async def reset_context(self, session_id: str, *, restart: bool = False,
                            origin: str = "reset-context") -> dict[str, Any]:
        b = self.backend
        b.executions.check_launch(session_id)
        async with self.live.lock(session_id):
            self._check_resettable(session_id)
            # RESETCFG-1, RESETCFG-5: one snapshot, before any new provider session exists
            snapshot = await self.capture(session_id)
            # Again, with nothing awaited from here to STARTING: the capture may have asked the
            # control server, and meanwhile the agent may have been stopped, a turn begun or the
            # task's deletion begun (none of them takes this session's lock).
            ex = self._check_resettable(session_id)
            with b.store.session() as db:
                session = get_session(db, session_id)
                meta = SessionMetadata.load(session)
                meta.set_context_reset(status="resetting", at=iso(), origin=origin, captured=snapshot.to_json())
                transitions.transition_session(db, session_id, SessionState.STARTING, expected_from={SessionState.WAITING_FOR_INPUT},
                                               reason=f"context reset ({origin})", metadata_json=meta.to_json())
            try:
                ex, info, path, launched = await self._new_provider_session(ex, restart)
            except BaseException as exc:
                self._reset_not_started(session_id, exc)
                if isinstance(exc, IpcError):
                    raise IpcError(exc.code, f"context reset failed before a new provider session existed:"
                                   f" {exc.message}", exc.retryable) from None
                raise
            catalogue = self._record_new_session(session_id, ex, info, path, launched)
            client = self.live.client(ex)
            try:
                applied = await rc.restore(snapshot, InstanceAgent(client, ex.instance_id), catalogue)
            except rc.ApplyRejected as rej:
                await self._reset_failed(session_id, ex, snapshot, rej, path)
                raise IpcError(ErrorCode.AGENT_ERROR,
                               f"context reset failed: {rej}; the session is FAILED (kandev resume continues the"
                               " new provider session)", False) from None
            except BaseException as exc:
                await self._reset_failed(session_id, ex, snapshot, exc, path)
                raise
            await self.live.converge(ex, applied.last_seq)
            return self._reset_succeeded(session_id, ex, snapshot, applied, path, origin)

    def _check_resettable(self, session_id: str) -> Execution:
        """The session's live execution, if a context reset may begin now: the agent tracked, the
        session waiting for input, its task not being deleted; else a conflict."""
        ex = self.live.live_execution(session_id)
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            state, task_id = session.state, session.task_id
        if state != SessionState.WAITING_FOR_INPUT:
            raise conflict(f"session {session_id} is {state}; a context reset needs WAITING_FOR_INPUT")
        refuse_while_deleting(self.backend.deleting_tasks, task_id,
                              f"session {session_id} does not reset its context")
        return ex

    async def _new_provider_session(self, ex: Execution, restart: bool,
                                    ) -> tuple[Execution, dict[str, Any], str, Launched | None]:
        client = self.live.client(ex)
        if not restart:
            try:
                info: dict[str, Any] = dict(await client.reset_context(ex.instance_id))
                ex.acp_session_id = info.get("acp_session_id")
                return ex, info, "acp", None
            except IpcError as exc:
                if exc.code != ErrorCode.UNKNOWN_OP:
                    raise
                log.info("control server has no reset_context: context reset by process restart")
        # Fallback: the agent process restarted, with a new provider session (session/new).
        sid = ex.session_id
        with self.backend.store.session() as db:
            session = get_session(db, sid)
            task = db.get(Task, session.task_id)
            meta = SessionMetadata.load(session)
            agent_name, passthrough = session.agent, bool(session.passthrough)
            workspace = task.workspace if task is not None else None
            executor = task.executor if task is not None else "local"
        if not workspace or not os.path.isdir(workspace):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the workspace {workspace!r} no longer exists")
        snapshot = meta.git_credential_snapshot
        # Credentials are untouched by a reset (RESETCFG-13): the same lease file, the same routing,
        # the same sandbox. The old agent is stopped under the launch gate, after the sandbox check.
        plan = LaunchPlan(session_id=sid, task_id=ex.task_id, agent=get_agent(agent_name), agent_name=agent_name,
                          workspace=workspace, executor=executor, passthrough=passthrough,
                          keep_lease=snapshot.get("policy") == POLICY_GITHUB_LEASE,
                          replaces=ex.instance_id, client=client)

        async def drained() -> None:
            with contextlib.suppress(IpcError):
                for inst in await client.list_instances():
                    if inst.get("instance_id") == ex.instance_id:
                        await self.live.converge(ex, int(inst.get("next_seq") or 1) - 1)
            await self.live.untrack(ex)

        launched = await self.launcher.launch(plan, before_create=drained)
        new = self.launcher.track(launched, last_seq=launched.handshake_seq)
        return new, {**launched.info, "endpoint": launched.endpoint}, "restart", launched

    def _reset_not_started(self, session_id: str, exc: BaseException) -> None:
        """No new provider session: the old conversation stays; back to WAITING_FOR_INPUT (tokens kept)."""
        reason = exc.message if isinstance(exc, IpcError) else (str(exc) or type(exc).__name__)
        live = session_id in self.backend.executions.executions
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            meta.update_context_reset(status="failed", at=iso(), stage="new_session", error=reason[:2000])
            if not live:
                row = db.get(ExecutorRunning, session_id)
                if row is not None:
                    row.status = "stale"
                    row.updated_at = _now()
            with contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, SessionState.WAITING_FOR_INPUT, expected_from={SessionState.STARTING},
                    reason=f"context reset failed: {reason[:200]}", last_error=f"context reset failed: {reason[:2000]}",
                    metadata_json=meta.to_json(),
                )

    def _record_new_session(self, session_id: str, ex: Execution, info: dict[str, Any], path: str,
                            launched: Launched | None) -> rc.Catalogue:
        """A new provider session exists: both tokens now name it (RESUME-2, RESUME-3), and what it reports
        as current (its defaults) is stored truthfully (RESETCFG-12); restore does not read it."""
        catalogue = rc.Catalogue.from_json(info)
        acp_id = info["acp_session_id"]
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            meta.set_acp_session_id(acp_id)
            meta.set_runtime_config(self.live.reported_over(None, catalogue).to_json())
            meta.set_acp_catalogue(catalogue.to_json())
            meta.update_context_reset(status="restoring", path=path, acp_session_id=acp_id)
            meta.save(session)
            row = db.get(ExecutorRunning, session_id)
            if row is not None:
                row.resume_token = acp_id
                row.updated_at = _now()
            if launched is not None:  # the restart path: the row names the new instance
                self.launcher.record_live(db, launched, last_event_seq=launched.handshake_seq, in_place=True)
        self.live.catalogues[session_id] = catalogue
        self.live.configs.pop(session_id, None)  # the old session's cache says nothing about the new one
        return catalogue

    async def _reset_failed(self, session_id: str, ex: Execution, snapshot: rc.SessionRuntimeConfig,
                            failure: BaseException, path: str) -> None:
        """RESETCFG-9, RESETCFG-10, RESETCFG-11: the accepted state stored truthfully, the failure status persisted, the
        execution failed (agent stopped), no ready and no reset event."""
        if isinstance(failure, rc.ApplyRejected):
            await self.live.converge(ex, failure.last_seq)
            accepted, catalogue, error = failure.accepted, failure.catalogue, str(failure)
            fld = failure.field
        else:
            accepted, catalogue = self.live.configs.get(session_id) or rc.SessionRuntimeConfig(), rc.Catalogue()
            error = failure.message if isinstance(failure, IpcError) else (str(failure) or type(failure).__name__)
            fld = None
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            put_runtime(meta, accepted, catalogue)
            meta.update_context_reset(status="failed", at=iso(), path=path, stage="restore", field=fld,
                                      error=error[:2000], captured=snapshot.to_json(), accepted=accepted.to_json())
            row = db.get(ExecutorRunning, session_id)
            if row is not None:
                row.status = "stale"  # the token (the new provider session) is kept for a resume
                row.updated_at = _now()
            with contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, SessionState.FAILED, expected_from={SessionState.STARTING},
                    reason=f"context reset failed: {error[:200]}", last_error=f"context reset failed: {error[:2000]}",
                    metadata_json=meta.to_json(),
                )
            self.live.message(db, session_id, "context_reset_failed", {"error": error[:2000], "field": fld,
                                                                   "accepted": accepted.to_json()})
        self.live.configs[session_id] = accepted
        await self.live.untrack(ex)
        with contextlib.suppress(Exception):
            await self.live.client(ex).stop_instance(ex.instance_id)
        log_event("context_reset_failed", f"session {session_id}: context reset failed: {error}", priority=3,
                  SESSION_ID=session_id, TASK_ID=ex.task_id, INSTANCE_ID=ex.instance_id, REASON=fld or "error")

    def _reset_succeeded(self, session_id: str, ex: Execution, snapshot: rc.SessionRuntimeConfig,
                         applied: rc.Applied, path: str, origin: str) -> dict[str, Any]:
        value = applied.accepted
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            put_runtime(meta, value, applied.catalogue)
            meta.update_context_reset(status="succeeded", at=iso(), path=path, origin=origin,
                                      acp_session_id=ex.acp_session_id, runtime_config=value.to_json())
            # The new session is announced ready only now that restore succeeded (RESETCFG-10).
            self.launcher.ready(db, session_id, ex.task_id, "agent ready (context reset)", task_review=False,
                                metadata_json=meta.to_json(), last_error=None)
            self.live.message(db, session_id, "context_reset", {
                "acp_session_id": ex.acp_session_id, "path": path, "origin": origin,
                "runtime_config": value.to_json()})
        self.live.configs[session_id] = value
        self.live.catalogues[session_id] = applied.catalogue
        log_event("context_reset", f"session {session_id}: context reset ({path}), provider session"
                  f" {ex.acp_session_id}, runtime configuration restored", SESSION_ID=session_id,
                  TASK_ID=ex.task_id, INSTANCE_ID=ex.instance_id, PATH=path)
        return {"session_id": session_id, "state": SessionState.WAITING_FOR_INPUT, "path": path,
                "acp_session_id": ex.acp_session_id, "resume_token": ex.acp_session_id,
                "runtime_config": value.to_json(), "captured": snapshot.to_json(),
                "calls": [list(c) for c in applied.calls]}
