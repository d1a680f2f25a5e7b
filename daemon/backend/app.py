"""The backend's request handlers and runtime state (one object, one event loop).

``Backend`` owns the store handle, the execution store, the client of the
control server it uses and the recovery report; ``daemon.backend.main``
builds it in the startup order and serves ``api.TABLE`` with ``handlers()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

import daemon.backend.credentials_api as credentials_api
import daemon.backend.resume_api as resume_api
import daemon.backend.runtimes_api as runtimes_api
from daemon.agentctl.client import AgentctlClient, OwnershipRefused, identify
from daemon.agents.registry import get_agent
from daemon.backend.adoption import Adopter
from daemon.backend.events import _ensure_turn
from daemon.backend.executions import EventConsumer, Execution, ExecutionStore
from daemon.backend.launcher import ControlServerHandle, Launcher, UnitBusy
from daemon.backend.recovery import Recovery, RecoveryReport
from daemon.backend.server_upgrade import LaunchGate, ServerUpgrade
from daemon.config import Config
from daemon.credentials import (
    CredentialError,
    GitCredentials,
    prepare_git_credentials,
    record_credential_snapshot,
)
from daemon.journal import log_event
from daemon.paths import Paths
from daemon.platform import CapabilityStatus
from daemon.store import transitions
from daemon.store.board import board
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord, ExecutorRunning, Message, Task, TaskSession, Turn
from daemon.version import VERSION as KANDEV_VERSION
from ipc.aio import cancel_and_wait
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext

log = logging.getLogger(__name__)

VERSION = KANDEV_VERSION
EXECUTORS = ("local", "worktree")


def _now() -> datetime:
    return datetime.now(UTC)


def _not_found(what: str, ident: str) -> IpcError:
    return IpcError(ErrorCode.NOT_FOUND, f"no {what} with id {ident!r}")


class Backend:
    """Runtime state of one backend process lifetime."""

    def __init__(
        self,
        paths: Paths,
        config: Config,
        capability: CapabilityStatus,
        store: Store,
        installation_id: str,
    ) -> None:
        self.paths = paths
        self.config = config
        self.capability = capability
        self.store = store
        self.installation_id = installation_id
        self.boot_id = uuid.uuid4().hex
        self.state = "starting"
        self.enabled = capability.state == "enabled"
        if self.enabled:
            mode = "unit" if capability.supervisor == "systemd" else "detached"
        else:
            mode = "child"
        self.launcher = Launcher(paths, config, installation_id, mode)
        self.executions = ExecutionStore()
        self.client: AgentctlClient | None = None
        self.handle: ControlServerHandle | None = None
        self.server_identity: str | None = None
        # Passthrough sessions run on a control server that is always our child
        # (AC-EXECUTORS-SURVIVAL-005.3): it dies with the backend whatever the switch says.
        self.passthrough_launcher = Launcher(paths, config, installation_id, "child")
        self.passthrough_client: AgentctlClient | None = None
        self.passthrough_handle: ControlServerHandle | None = None
        self.consumer = EventConsumer(store, self._client_for, self._on_gone)
        self.report = RecoveryReport()
        self.credential: bytes | None = None  # current ownership credential (memory + 0600 file only)
        self.claim_tasks: dict[str, asyncio.Task[None]] = {}  # endpoint -> its renewal loop
        self.fallback_reason: str | None = None
        self.shutdown_requested = asyncio.Event()
        self.socket_path = str(paths.backend_socket)
        # Keeping the control server on the installed version (issue 15): reload or replace-when-idle.
        self.launch_gate = LaunchGate()
        self.upgrade = ServerUpgrade(self)

    # ------------------------------------------------------------ lifecycle
    def _client_for(self, ex: Execution) -> AgentctlClient | None:
        return self.passthrough_client if ex.passthrough else self.client

    def _on_gone(self, ex: Execution) -> None:
        self.executions.executions.pop(ex.session_id, None)

    def _superseded(self, client: AgentctlClient) -> None:
        """An operation was refused for a superseded credential: another holder of this
        installation's credential adopted the server. Its executions are no longer ours: forget
        them, stop renewing, and never retry; nothing is stopped (OWNERSHIP-002.3)."""
        client.on_superseded = None  # once
        passthrough = client is self.passthrough_client
        lost = [ex for ex in self.executions.executions.values() if ex.passthrough == passthrough]
        for ex in lost:
            ex.gone = True
            self._on_gone(ex)
            ex.fail_waiters("superseded_credential")
            if ex.consumer is not None:
                ex.consumer.cancel()
        claims = self.claim_tasks.pop(client.socket_path, None)
        if claims is not None:
            claims.cancel()
        log_event("ownership_lost", f"control server at {client.socket_path} was adopted with this installation's"
                  f" credential by someone else: {len(lost)} execution(s) no longer tracked, nothing stopped",
                  priority=4, REASON="superseded_credential", COUNT=len(lost))

    async def _connect(self, handle: ControlServerHandle, credential: bytes) -> tuple[AgentctlClient, dict[str, Any]]:
        info = await identify(handle.endpoint, timeout=5.0)
        if info is None:
            raise IpcError(ErrorCode.UNAVAILABLE, f"control server at {handle.endpoint} does not answer")
        client = await AgentctlClient.connect(
            handle.endpoint,
            credential=credential,
            installation_id=self.installation_id,
            expected_identity=info["server_identity"],
        )
        await client.claim()
        return client, info

    async def start_own_server(self) -> AgentctlClient:
        """Start a fresh control server and record it as the one this installation uses.

        Under systemd the unit can hold only one server: if it runs one this backend
        could not adopt, that server is never stopped (AC-EXECUTORS-CONTROL-OWNERSHIP-001.4)
        and this backend uses a child server until the survivor's unowned shutdown.
        """
        try:
            handle, credential = await self.launcher.start()
        except UnitBusy as exc:
            self.fallback_reason = str(exc)
            log_event("control_server_fallback", f"{exc}; using a control server bound to this backend",
                      priority=4, REASON="unit_busy")
            handle, credential = await self.passthrough_launcher.start()
        client, info = await self._connect(handle, credential)
        self.credential = credential
        self._start_claims(client, handle.endpoint, info["server_identity"], credential)
        self.handle = handle
        self.server_identity = info["server_identity"]
        with self.store.session() as db:
            rec = db.get(ControlServerRecord, 1) or ControlServerRecord(id=1)
            rec.endpoint = handle.endpoint
            rec.server_identity = info["server_identity"]
            rec.credential_ref = handle.credential_ref
            rec.capabilities = list(info.get("capabilities") or [])
            rec.log_path = handle.log_path
            rec.pid = handle.pid
            rec.launch_mode = handle.mode
            rec.updated_at = _now()
            db.merge(rec)
        log_event(
            "control_server_started",
            f"started control server ({handle.mode}) pid {handle.pid} at {handle.endpoint}",
            MODE=handle.mode,
            SERVER_PID=handle.pid,
            SERVER_IDENTITY=info["server_identity"],
        )
        return client

    def _start_claims(self, client: AgentctlClient, endpoint: str, identity: str, credential: bytes) -> None:
        """Renew ownership every unowned period / 4 (AC-EXECUTORS-CONTROL-OWNERSHIP-003.2)."""
        old = self.claim_tasks.pop(endpoint, None)
        if old is not None:
            old.cancel()
        period = float(client.unowned_period_s or 600.0)
        self.claim_tasks[endpoint] = asyncio.get_running_loop().create_task(
            self._claim_loop(endpoint, identity, credential, period / 4), name=f"claims-{endpoint}"
        )

    async def _claim_loop(self, endpoint: str, identity: str, credential: bytes, interval: float) -> None:
        conn: AgentctlClient | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await AgentctlClient.connect(
                            endpoint, credential=credential, installation_id=self.installation_id,
                            expected_identity=identity,
                        )
                    await conn.claim()
                except OwnershipRefused as exc:
                    # Our credential no longer authenticates (another backend adopted it and confirmed),
                    # or another server answers there: nothing left to renew, no retry (002.3).
                    log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.reason}", priority=4,
                              REASON=exc.reason)
                    return
                except IpcError as exc:
                    if exc.code in (ErrorCode.SUPERSEDED_CREDENTIAL, ErrorCode.SHUTTING_DOWN):
                        # Another backend adopted it, or it is exiting: not ours to renew (002.3, 003.9).
                        log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.code}", priority=4,
                                  REASON=exc.code)
                        return
                    log.warning("ownership claim failed: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                except Exception as exc:  # a failed renewal never shortens the period
                    log.warning("ownership claim failed: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                await asyncio.sleep(interval)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    def _on_adopted(self, client: AgentctlClient, credential: bytes) -> None:
        # The claim loop starts as soon as the rotation is confirmed, not after re-tracking (003.8).
        self.credential = credential
        self._start_claims(client, client.socket_path, client.identity, credential)

    async def recover(self) -> None:
        self.state = "recovering"
        agentctl = self.config.agentctl
        adopter = Adopter(
            self.store,
            self.paths,
            self.installation_id,
            read_timeout_s=agentctl.recovery_read_timeout,
            read_retries=agentctl.recovery_read_retries,
            on_claim_ready=self._on_adopted,
        )
        recovery = Recovery(
            self.store,
            self.executions,
            adopter,
            deadline_s=agentctl.recovery_deadline,
            read_timeout_s=agentctl.recovery_read_timeout,
            read_retries=agentctl.recovery_read_retries,
            boot_id=self.boot_id,
        )
        report, client = await recovery.recover(
            enabled=self.enabled, start_own_server=self.start_own_server, publish=self._publish
        )
        self.client = client
        if client is not None:
            client.on_superseded = self._superseded
        self.report = report
        if report.adoption.outcome == "adopted" and report.adoption.record is not None:
            rec = report.adoption.record
            self.server_identity = rec.server_identity
            self.handle = ControlServerHandle(
                endpoint=rec.endpoint,
                mode=rec.launch_mode,
                credential_ref=rec.credential_ref,
                log_path=rec.log_path,
                pid=rec.pid,
            )
            with self.store.session() as db:
                stored = db.get(ControlServerRecord, 1)
                if stored is not None:
                    stored.capabilities = list(client.capabilities)
                    stored.updated_at = _now()
        for ex in list(self.executions.executions.values()):
            if ex.consumer is None:
                self.consumer.start(ex)
        self.state = "ready"
        self.upgrade.start()

    def _publish(self, ex: Execution) -> None:
        self.executions.executions[ex.session_id] = ex

    async def shutdown(self) -> None:
        """Graceful stop. Enabled: detach, send no stop (AC-EXECUTORS-SURVIVAL-001.1). Disabled: stop it all."""
        self.state = "stopping"
        await self.upgrade.stop()
        await asyncio.gather(*(cancel_and_wait(task) for task in self.claim_tasks.values()))
        await self.consumer.stop(list(self.executions.executions.values()))
        for client in (self.client, self.passthrough_client):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
        if self.handle is not None and self.handle.mode == "child":
            await Launcher.terminate(self.handle)
        if self.passthrough_handle is not None:
            await Launcher.terminate(self.passthrough_handle)
        log_event(
            "backend_stopped",
            "backend stopped; " + ("agents left running (survival enabled)" if self.enabled else "agents stopped"),
            DETACHED=int(self.enabled),
        )

    # ------------------------------------------------------------- helpers
    def _task(self, db: Any, task_id: str) -> Task:
        task = db.get(Task, task_id)
        if task is None:
            raise _not_found("task", task_id)
        return task

    def _session(self, db: Any, session_id: str) -> TaskSession:
        session = db.get(TaskSession, session_id)
        if session is None:
            raise _not_found("session", session_id)
        return session

    def _workspace_for(self, task_id: str, workspace: str | None, executor: str) -> str:
        if executor == "worktree":
            if not workspace:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "executor 'worktree' needs --workspace (a git repository)")
            target = self.paths.worktrees_dir / task_id
            proc = subprocess.run(
                ["git", "-C", workspace, "worktree", "add", "-b", f"kandev/{task_id}", str(target)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if proc.returncode != 0:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"git worktree add failed: {proc.stderr.strip()}")
            return str(target)
        if workspace:
            path = Path(workspace)
            if not path.is_absolute() or not path.is_dir():
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"workspace {workspace!r} is not an existing absolute directory")
            return str(path)
        target = self.paths.worktrees_dir / task_id
        target.mkdir(parents=True, exist_ok=True)
        return str(target)

    # ------------------------------------------------------------ handlers
    def handlers(self) -> dict[str, Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]]:
        return {
            "status": self.op_status,
            "shutdown": self.op_shutdown,
            "agentctl_reload": self.op_agentctl_reload,
            "task_create": self.op_task_create,
            "session_start": self.op_session_start,
            "prompt": self.op_prompt,
            "cancel": self.op_cancel,
            "permission_respond": self.op_permission_respond,
            "session_show": self.op_session_show,
            "session_list": self.op_session_list,
            "board": self.op_board,
            # Handler tables of later features register here, one line each.
            **credentials_api.handlers(self),
            **resume_api.handlers(self),
            **runtimes_api.handlers(self),
        }

    async def op_status(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        handle = self.handle
        server_state = "none"
        if handle is not None:
            try:
                server_state = "running" if await identify(handle.endpoint, timeout=1.0) is not None else "unreachable"
            except IpcError as exc:
                server_state = "reloading" if exc.code == ErrorCode.RELOADING else "unreachable"
        if server_state == "running":
            await self.upgrade.refresh()
        report = self.report
        return {
            "backend": {
                "pid": os.getpid(),
                "version": VERSION,
                "socket": self.socket_path,
                "home": str(self.paths.home),
                "state": self.state,
            },
            "capability": {
                "state": self.capability.state,
                "reason": self.capability.reason,
                "detail": self.capability.detail,
                "supervisor": self.capability.supervisor,
            },
            "control_server": {
                "state": server_state,
                "pid": handle.pid if handle else None,
                "server_identity": self.server_identity,
                "endpoint": handle.endpoint if handle else None,
                "mode": handle.mode if handle else None,
                "log_path": handle.log_path if handle else None,
                # running and installed versions, reload ability and history (issue 15)
                **self.upgrade.status(),
            },
            "recovery": {
                "retracked": len(report.retracked),
                "not_retracked": len(report.not_retracked),
                "reasons": dict(report.not_retracked),
                "stopped_orphans": len(report.stopped_orphans),
                "duration_ms": round(report.duration_ms, 1),
            },
            "adoption": {"outcome": report.adoption.outcome, "reason": report.adoption.reason},
        }

    async def op_agentctl_reload(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev agentctl reload``: the control server re-executes the installed code in place."""
        if self.state != "ready":
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {self.state}; retry shortly", True)
        result = await self.upgrade.reload()
        if result["outcome"] != "reexecuted":
            raise IpcError("reload_refused", f"the control server refused to reload: {result['reason']};"
                           f" version {result['version']} keeps serving (see journal KANDEV_EVENT=reload_refused)",
                           False)
        return result

    async def op_shutdown(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self.shutdown_requested.set()
        return {"ok": True, "detach": self.enabled}

    async def op_task_create(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        title = args["title"].strip()
        if not title:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "title must not be empty")
        executor = args.get("executor", "local")
        if executor not in EXECUTORS:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"executor must be one of {', '.join(EXECUTORS)}")
        task_id = uuid.uuid4().hex
        workspace = self._workspace_for(task_id, args.get("workspace"), executor)
        with self.store.session() as db:
            db.add(
                Task(
                    id=task_id,
                    title=title,
                    workspace=workspace,
                    executor=executor,
                    state="backlog",
                    interrupted=False,
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
        log_event("task_created", f"task {task_id} created", TASK_ID=task_id)
        return {"task_id": task_id, "workspace": workspace}

    async def _server_for(self, passthrough: bool) -> AgentctlClient:
        if passthrough:
            if self.passthrough_client is None:
                handle, credential = await self.passthrough_launcher.start()
                self.passthrough_client, info = await self._connect(handle, credential)
                self.passthrough_client.on_superseded = self._superseded
                self.passthrough_handle = handle
                # It dies with us, but it must not reap itself while we live (OWN-003.1).
                self._start_claims(self.passthrough_client, handle.endpoint, info["server_identity"], credential)
            return self.passthrough_client
        if self.client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "the backend has no control server yet; retry shortly", True)
        return self.client

    def agent_base_env(self) -> dict[str, str]:
        """The environment every agent launch adds to the control server's (the mock's state dir)."""
        mock_state = self.paths.home / "agents" / "mock-state"
        mock_state.mkdir(parents=True, exist_ok=True)
        return {"KANDEV_MOCK_STATE_DIR": str(mock_state)}

    def git_credentials(self, session_id: str, env: dict[str, str]) -> GitCredentials:
        """Issue the session's git credential lease and store the non-secret snapshot, for a launch
        of a session that is already durably STARTING (RESUME-5, RESUME-6, RESUME-9): policy
        ``none`` when the workspace is not GitHub-backed or no upstream token is configured."""
        with self.store.session() as db:
            creds = prepare_git_credentials(db, session_id, paths=self.paths, config=self.config.credentials,
                                            base_env=env)
            record_credential_snapshot(db, session_id, creds.snapshot)
            return creds

    async def op_session_start(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        if self.state != "ready":
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {self.state}; retry shortly", True)
        agent_name = args.get("agent", "mock")
        try:
            agent = get_agent(agent_name)
        except KeyError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc.args[0] if exc.args else exc)) from None
        passthrough = bool(args.get("passthrough", False))
        session_id = uuid.uuid4().hex
        with self.store.session() as db:
            task = self._task(db, args["task_id"])
            task_id, workspace = task.id, task.workspace
            db.add(
                TaskSession(
                    id=session_id,
                    task_id=task_id,
                    agent=agent_name,
                    state="CREATED",
                    metadata_json={"runtime_config": {"model": None, "mode": None, "options": {}}},
                    passthrough=passthrough,
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
            db.flush()
            transitions.transition_session(db, session_id, "STARTING", expected_from={"CREATED"}, reason="start")
        env = self.agent_base_env()
        stage = "git credentials"
        try:
            # A GitHub-backed workspace gets its scoped lease now that STARTING is durable (as a resume does).
            creds = await asyncio.to_thread(self.git_credentials, session_id, env)
            env.update(creds.env)
            stage = "control server"
            async with self.launch_gate.launch():  # the server is not replaced under a launch
                client = await self._server_for(passthrough)
                handle = self.passthrough_handle if passthrough else self.handle
                assert handle is not None
                stage = "launch"
                info = await client.create_instance(
                    session_id=session_id,
                    task_id=task_id,
                    command=list(agent.argv()),
                    cwd=workspace,
                    env=env,
                    agent=agent_name,
                )
        except BaseException as exc:
            # Whatever failed after STARTING, the session does not stay STARTING.
            error = exc.to_ipc() if isinstance(exc, CredentialError) else exc
            message = error.message if isinstance(error, IpcError) else (str(error) or type(error).__name__)
            with self.store.session() as db, contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, "FAILED", expected_from={"STARTING"}, reason=f"start failed ({stage})",
                    last_error=f"{stage}: {message}",
                )
            if stage == "launch" and isinstance(error, IpcError):
                raise IpcError(ErrorCode.AGENT_ERROR, f"agent failed to start: {message}") from None
            if error is not exc:
                raise error from None
            raise
        with self.store.session() as db:
            session = self._session(db, session_id)
            meta = dict(session.metadata_json or {})
            meta["acp"] = {"session_id": info.get("acp_session_id")}
            session.metadata_json = meta
            db.merge(
                ExecutorRunning(
                    session_id=session_id,
                    task_id=task_id,
                    instance_id=info["instance_id"],
                    endpoint=handle.endpoint,
                    agent_pid=info.get("pid"),
                    agent_pid_start_time=info.get("pid_start_time"),
                    resume_token=info.get("acp_session_id"),
                    worktree_path=workspace if task.executor == "worktree" else None,
                    workspace_path=workspace,
                    runtime="standalone",
                    agent_profile=agent_name,
                    status="live",
                    last_event_seq=0,
                    created_by_boot=self.boot_id,
                    metadata_json={},
                    created_at=_now(),
                    updated_at=_now(),
                )
            )
            transitions.transition_session(
                db, session_id, "WAITING_FOR_INPUT", expected_from={"STARTING"}, reason="agent ready"
            )
            transitions.set_task_state(db, task_id, "review")
        ex = Execution(
            session_id=session_id,
            task_id=task_id,
            instance_id=info["instance_id"],
            agent_pid=info.get("pid"),
            agent_pid_start_time=info.get("pid_start_time"),
            acp_session_id=info.get("acp_session_id"),
            passthrough=passthrough,
        )
        self.executions.executions[session_id] = ex
        self.consumer.start(ex)
        log_event(
            "session_started",
            f"session {session_id} started: agent {agent_name} pid {ex.agent_pid}",
            SESSION_ID=session_id,
            TASK_ID=task_id,
            INSTANCE_ID=ex.instance_id,
            AGENT_PID=ex.agent_pid,
        )
        result: dict[str, Any] = {"session_id": session_id, "turn_id": None, "credential_policy": creds.policy}
        if args.get("prompt"):
            started = await self._prompt(session_id, args["prompt"], wait=False)
            result["turn_id"] = started["turn_id"]
        return result

    async def _prompt(self, session_id: str, text: str, *, wait: bool) -> dict[str, Any]:
        self.executions.check_launch(session_id)
        ex = self.executions.executions.get(session_id)
        with self.store.session() as db:
            session = self._session(db, session_id)
            if ex is None:
                raise IpcError(
                    ErrorCode.CONFLICT, f"session {session_id} has no running agent (state {session.state})"
                )
            if session.state != "WAITING_FOR_INPUT":
                raise IpcError(ErrorCode.CONFLICT, f"session {session_id} is {session.state}; a turn is in progress")
            transitions.transition_session(
                db, session_id, "RUNNING", expected_from={"WAITING_FOR_INPUT"}, reason="prompt"
            )
            transitions.set_task_state(db, session.task_id, "in_progress")
        client = self._client_for(ex)
        try:
            if client is None:
                raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
            turn_id = str(await client.prompt(ex.instance_id, text))
        except IpcError as exc:
            with self.store.session() as db:
                with contextlib.suppress(transitions.TransitionConflict):
                    transitions.transition_session(
                        db, session_id, "WAITING_FOR_INPUT", expected_from={"RUNNING"}, reason="prompt refused",
                        last_error=exc.message,
                    )
                    transitions.set_task_state(db, ex.task_id, "review")
            raise
        waiter = ex.wait_turn(turn_id) if wait else None
        with self.store.session() as db:
            turn = _ensure_turn(db, session_id, turn_id, text)
            finished = turn.state != "open"
            stop_reason = turn.stop_reason
        result: dict[str, Any] = {"turn_id": turn_id}
        if waiter is not None:
            if finished:
                ex.resolve_turn(turn_id, stop_reason)
            result["stop_reason"] = await waiter
        return result

    async def op_prompt(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await self._prompt(args["session_id"], args["text"], wait=bool(args.get("wait", False)))

    async def op_cancel(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        session_id = args["session_id"]
        with self.store.session() as db:
            self._session(db, session_id)
        ex = self.executions.executions.get(session_id)
        if ex is None:
            raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no running agent")
        client = self._client_for(ex)
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
        await client.cancel(ex.instance_id)
        return {"ok": True}

    async def op_permission_respond(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        session_id, request_id = args["session_id"], args["request_id"]
        option_id = args.get("option_id")
        with self.store.session() as db:
            self._session(db, session_id)
        ex = self.executions.executions.get(session_id)
        client = self._client_for(ex) if ex is not None else None
        if ex is None or client is None:
            raise IpcError(ErrorCode.CONFLICT, f"session {session_id} has no running agent")
        await client.respond_permission(ex.instance_id, request_id, option_id)
        with self.store.session() as db:
            db.add(
                Message(
                    session_id=session_id,
                    turn_id=None,
                    role="user",
                    kind="permission_response",
                    text=json.dumps({"request_id": request_id, "option_id": option_id}, sort_keys=True),
                    created_at=_now(),
                )
            )
        return {"ok": True}

    @staticmethod
    def _permissions(messages: list[Message]) -> list[dict[str, Any]]:
        """Permission requests of the transcript, each open until answered."""
        requests: dict[str, dict[str, Any]] = {}
        for m in messages:
            if m.kind not in ("permission_request", "permission_response", "permission_cancelled"):
                continue
            try:
                data = json.loads(m.text)
            except ValueError:
                continue
            rid = str(data.get("request_id"))
            if m.kind == "permission_request":
                options = [o.get("optionId") or o.get("option_id") for o in data.get("options") or []
                           if isinstance(o, dict)]
                requests[rid] = {"request_id": rid, "turn_id": data.get("turn_id"), "options": options,
                                 "state": "open", "answer": None}
            elif rid in requests and m.kind == "permission_cancelled":
                requests[rid]["state"] = "cancelled"
            elif rid in requests:
                requests[rid]["state"] = "answered"
                requests[rid]["answer"] = data.get("option_id")
        return list(requests.values())

    async def op_session_show(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        session_id = args["session_id"]
        ex = self.executions.executions.get(session_id)
        with self.store.session() as db:
            session = self._session(db, session_id)
            row = db.get(ExecutorRunning, session_id)
            turns = db.scalars(select(Turn).where(Turn.session_id == session_id).order_by(Turn.ordinal)).all()
            messages = db.scalars(select(Message).where(Message.session_id == session_id).order_by(Message.id)).all()
            meta = dict(session.metadata_json or {})
            runtime = meta.get("runtime_config") or {"model": None, "mode": None, "options": {}}
            return {
                "session_id": session.id,
                "task_id": session.task_id,
                "state": session.state,
                "agent": session.agent,
                "passthrough": bool(session.passthrough),
                "agent_pid": ex.agent_pid if ex else (row.agent_pid if row else None),
                "agent_pid_start_time": ex.agent_pid_start_time if ex else (row.agent_pid_start_time if row else None),
                "instance_id": ex.instance_id if ex else (row.instance_id if row else None),
                "resume_token": row.resume_token if row else (meta.get("acp") or {}).get("session_id"),
                "retracked": bool(ex.retracked) if ex else False,
                "live": ex is not None,
                "recoverable": ex is None and session.state not in ("COMPLETED",) and row is not None,
                "not_retracked_reason": self.report.not_retracked.get(session_id),
                "guard": self.executions.guards.get(session_id),
                "last_error": session.last_error,
                "runtime_config": runtime,
                "permissions": self._permissions(list(messages)),
                "turns": [
                    {"turn_id": t.id, "state": t.state, "stop_reason": t.stop_reason, "prompt": t.prompt}
                    for t in turns
                ],
                "transcript": [
                    {"role": m.role, "kind": m.kind, "text": m.text, "turn_id": m.turn_id, "seq": m.event_seq}
                    for m in messages
                ],
            }

    async def op_session_list(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        with self.store.session() as db:
            sessions = db.scalars(select(TaskSession).order_by(TaskSession.created_at)).all()
            return {
                "sessions": [
                    {
                        "session_id": s.id,
                        "task_id": s.task_id,
                        "state": s.state,
                        "retracked": bool(
                            (ex := self.executions.executions.get(s.id)) is not None and ex.retracked
                        ),
                    }
                    for s in sessions
                ]
            }

    async def op_board(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        with self.store.session() as db:
            return board(db)


async def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
