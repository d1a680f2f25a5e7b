"""The backend's request handlers and runtime state (one object, one event loop).

``Backend`` owns the store handle, the execution store, the client of the
control server it uses and the recovery report; ``daemon.backend.main``
builds it in the startup order and serves ``api.TABLE`` with ``handlers()``.
Each control server it uses has a ``ControlServerLink`` (``daemon.backend.control_link``)
that watches it and, when it dies, has the backend make its sessions truthful and
start a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

import daemon.backend.agent_launch as agent_launch
import daemon.backend.credentials_api as credentials_api
import daemon.backend.hygiene as hygiene
import daemon.backend.ids as ids
import daemon.backend.resume_api as resume_api
import daemon.backend.runtime_prepare as runtime_prepare
import daemon.backend.runtimes_api as runtimes_api
import daemon.backend.task_delete as task_delete
from daemon.agentctl.client import AgentctlClient, OwnershipRefused, identify
from daemon.agents.registry import get_agent
from daemon.backend.adoption import Adopter
from daemon.backend.api import TABLE
from daemon.backend.control_link import Attached, ControlServerLink, LinkState, Loss
from daemon.backend.credential_endpoints import CredentialEndpoints
from daemon.backend.events import _ensure_turn
from daemon.backend.executions import EventConsumer, Execution, ExecutionStore
from daemon.backend.follow import FollowService
from daemon.backend.launcher import ControlServerHandle, Launcher, UnitBusy
from daemon.backend.recovery import LostAgent, Recovery, RecoveryReport, repair_lost_server
from daemon.backend.server_upgrade import LaunchGate, ServerUpgrade
from daemon.backend.server_watch import ServerWatch
from daemon.backend.session_view import PageRequest, StoredSession, read_session
from daemon.backend.transcript_hub import TranscriptHub
from daemon.backend.views import Views
from daemon.backend.worktree import add_worktree
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
from daemon.runtimes.update import RuntimeJobs
from daemon.store import transitions
from daemon.store.board import board
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord, ExecutorRunning, Message, Task, TaskSession
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
        self.deleting_tasks: set[str] = set()  # tasks a task_delete is removing: no new agent for them
        self.client: AgentctlClient | None = None
        self.handle: ControlServerHandle | None = None
        self.server_identity: str | None = None
        # Passthrough sessions run on a control server that is always our child
        # (AC-EXECUTORS-SURVIVAL-005.3): it dies with the backend whatever the switch says.
        self.passthrough_launcher = Launcher(paths, config, installation_id, "child")
        self.passthrough_client: AgentctlClient | None = None
        self.passthrough_handle: ControlServerHandle | None = None
        self.consumer = EventConsumer(store, self._client_for, self._on_gone)
        self.transcripts = TranscriptHub()  # wakes follow streams on store commits
        self.transcripts.observe(store)
        self.views = Views(store, self.executions)
        self.report = RecoveryReport()
        self.credential: bytes | None = None  # current ownership credential (memory + 0600 file only)
        self.claim_tasks: dict[str, asyncio.Task[None]] = {}  # endpoint -> its renewal loop
        self.fallback_reason: str | None = None
        self.runtime_jobs: RuntimeJobs | None = None  # set by runtimes_api.handlers
        self.shutdown_requested = asyncio.Event()
        self.socket_path = str(paths.backend_socket)
        # The life of each control server (watch, lose, restart, give up): daemon.backend.control_link.
        self.link = ControlServerLink(
            "survival", start=self._restart_own_server, on_restarted=self._resume_interrupted,
            on_lost=lambda attached, loss: self._server_lost(attached, loss, passthrough=False))
        self.passthrough_link = ControlServerLink(
            "passthrough", start=self._start_passthrough_server, on_restarted=self._resume_interrupted,
            on_lost=lambda attached, loss: self._server_lost(attached, loss, passthrough=True))
        self.resume_service: resume_api.ResumeService | None = None  # set by resume_api.handlers
        self._first_failure: str | None = None  # why startup could not start a control server
        # Each live session's git credential endpoint: all an agent can reach of the backend.
        self.endpoints = CredentialEndpoints(store, paths.home, config.credentials)
        # Keeping the control server on the installed version (Issue 15): reload or replace-when-idle.
        self.launch_gate = LaunchGate()
        self.upgrade = ServerUpgrade(self)

    # ------------------------------------------------------------ lifecycle
    def _client_for(self, ex: Execution) -> AgentctlClient | None:
        return self.passthrough_client if ex.passthrough else self.client

    def _on_gone(self, ex: Execution) -> None:
        self.executions.executions.pop(ex.session_id, None)
        self.endpoints.close_soon(ex.session_id)

    def _superseded(self, client: AgentctlClient) -> None:
        """An operation was refused for a superseded credential: another holder of this
        installation's credential adopted the server. Its executions are no longer ours: forget
        them, stop renewing, and never retry; nothing is stopped (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3)."""
        client.on_superseded = None  # once
        passthrough = client is self.passthrough_client
        self._release_link(client.socket_path)  # not ours: neither watched nor restarted
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
                    # or another server answers there: nothing left to renew, no retry (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3).
                    log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.reason}", priority=4,
                              REASON=exc.reason)
                    self._release_link(endpoint)
                    return
                except IpcError as exc:
                    if exc.code in (ErrorCode.SUPERSEDED_CREDENTIAL, ErrorCode.SHUTTING_DOWN):
                        # Another backend adopted it, or it is exiting: not ours to renew (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3, AC-EXECUTORS-CONTROL-OWNERSHIP-003.9).
                        log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.code}", priority=4,
                                  REASON=exc.code)
                        if exc.code == ErrorCode.SUPERSEDED_CREDENTIAL:
                            self._release_link(endpoint)  # one that exits is a loss its link handles
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
        # The claim loop starts as soon as the rotation is confirmed, not after re-tracking (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8).
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
            enabled=self.enabled, start_own_server=self._first_server, publish=self._publish
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
        if client is not None and self.handle is not None:
            self.link.attach(self._attached(self.handle, client))
        elif self._first_failure is not None:
            self.link.start_failed(self._first_failure)  # the backend stays up; its link keeps trying
        # A re-tracked agent's sandbox still has its endpoint's directory: serve a new socket there.
        await self.endpoints.reopen_for(list(self.executions.executions))
        await hygiene.tidy_home_async(self)
        self.state = "ready"
        self.upgrade.start()

    def _publish(self, ex: Execution) -> None:
        self.executions.executions[ex.session_id] = ex

    async def shutdown(self) -> None:
        """Graceful stop. Enabled: detach, send no stop (AC-EXECUTORS-SURVIVAL-001.1). Disabled: stop it all."""
        self.state = "stopping"
        await self.upgrade.stop()  # no replacement of an old server starts or goes on now
        await asyncio.gather(self.link.close(), self.passthrough_link.close())  # what follows is no loss
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
        await self.endpoints.close_all()
        log_event(
            "backend_stopped",
            "backend stopped; " + ("agents left running (survival enabled)" if self.enabled else "agents stopped"),
            DETACHED=int(self.enabled),
        )

    # ------------------------------------------------ control-server losses
    def _attached(self, handle: ControlServerHandle, client: AgentctlClient) -> Attached:
        return Attached(handle, client, ServerWatch(handle, lambda: client.closed))

    def _release_link(self, endpoint: str) -> None:
        for link in (self.link, self.passthrough_link):
            if link.attached is not None and link.attached.handle.endpoint == endpoint:
                link.release()

    async def _server_lost(self, attached: Attached, loss: Loss, *, passthrough: bool) -> list[str]:
        """A control server died under us (its link saw it): forget it, make every session that
        lived on it truthful as startup recovery would with no server left, and remove what we
        wrote for it. Returns the sessions interrupted."""
        handle: ControlServerHandle = attached.handle
        if passthrough:
            self.passthrough_client, self.passthrough_handle = None, None
        else:
            self.client, self.handle = None, None
        claims = self.claim_tasks.pop(handle.endpoint, None)
        if claims is not None:
            await cancel_and_wait(claims)
        dropped = await self.executions.drop(lambda ex: ex.passthrough == passthrough, "interrupted")
        for ex in dropped:  # their agents died with the server: nobody left to serve
            self.endpoints.close_soon(ex.session_id)
        tracked = [LostAgent(ex.session_id, ex.agent_pid, ex.agent_pid_start_time, ex.last_seq) for ex in dropped]
        with self.store.session() as db:
            repaired = repair_lost_server(db, endpoint=handle.endpoint, tracked=tracked, reason=loss.reason,
                                          now=_now())
        with contextlib.suppress(Exception):
            await attached.client.close()
        self.launcher.remove_files(handle)
        return repaired

    async def _first_server(self) -> AgentctlClient | None:
        """Startup recovery's start: a server that cannot be started does not stop the backend."""
        try:
            return await self.start_own_server()
        except Exception as exc:
            self._first_failure = f"start failed: {exc}" if str(exc) else f"start failed: {type(exc).__name__}"
            log_event("control_server_start_failed", f"could not start a control server: {exc}; the backend"
                      " keeps trying (kandev status)", priority=3, REASON=self._first_failure)
            return None

    async def _restart_own_server(self) -> Attached:
        """The survival link's restart: a fresh server the way startup starts one (unit, detached or child;
        a fresh credential and control-server record, its own claim loop)."""
        if self.launcher.mode == "unit":
            await self.launcher.wait_unit_settled()  # systemd may still be killing the old unit's cgroup
        client = await self.start_own_server()
        client.on_superseded = self._superseded
        self.client = client
        assert self.handle is not None
        return self._attached(self.handle, client)

    async def _start_passthrough_server(self) -> Attached:
        """A control server that is always our child, for passthrough sessions (AC-EXECUTORS-SURVIVAL-005.3)."""
        handle, credential = await self.passthrough_launcher.start()
        try:
            client, info = await self._connect(handle, credential)
        except BaseException:
            await Launcher.terminate(handle)
            self.passthrough_launcher.remove_files(handle)
            raise
        client.on_superseded = self._superseded
        self.passthrough_client, self.passthrough_handle = client, handle
        # It dies with us, but it must not reap itself while we live (AC-EXECUTORS-CONTROL-OWNERSHIP-003.1).
        self._start_claims(client, handle.endpoint, info["server_identity"], credential)
        return self._attached(handle, client)

    def _resume_interrupted(self, session_ids: list[str]) -> None:
        if self.resume_service is not None:
            self.resume_service.resume_interrupted(session_ids)

    @staticmethod
    def _no_server(link: ControlServerLink) -> IpcError:
        loss = link.last_loss
        why = f" (last loss: {loss.reason})" if loss is not None else ""
        if link.state == LinkState.GAVE_UP:
            return IpcError("control_server_unavailable",
                            f"the {link.name} control server kept dying and the backend gave up restarting it{why};"
                            " fix the cause, then `kandev up` tries again", False)
        return IpcError("control_server_unavailable",
                        f"the {link.name} control server is {link.state.value}{why}; retry shortly", True)

    async def op_control_server_retry(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev up`` with a backend that runs: try again where it gave up restarting a server."""
        retried = [link.name for link in (self.link, self.passthrough_link) if link.retry()]
        return {"retried": retried, "state": self.link.state.value,
                "passthrough_state": self.passthrough_link.state.value}

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

    # ------------------------------------------------------------ handlers
    def handlers(self) -> dict[str, Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]]:
        # Every op that takes a task or session id also takes a unique prefix of it (daemon.backend.ids).
        return ids.resolving(TABLE, self.store, {
            "status": self.op_status,
            "shutdown": self.op_shutdown,
            "agentctl_reload": self.op_agentctl_reload,
            "task_create": self.op_task_create,
            "session_start": self.op_session_start,
            "control_server_retry": self.op_control_server_retry,
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
            **task_delete.handlers(self),
            **self.views.handlers(),
            **FollowService(self.store, self.transcripts, self.executions).handlers(),
        })

    async def op_status(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        handle = self.handle
        link = self.link.snapshot()
        if handle is not None and link["state"] == LinkState.RUNNING.value:
            # running as far as its link can tell (its process is there): does it answer?
            try:
                if await identify(handle.endpoint, timeout=1.0) is None:
                    # running, but it does not answer (for a moment while it re-executes)
                    link["state"] = "reloading" if self.upgrade.reloading else "unreachable"
            except IpcError as exc:
                link["state"] = "reloading" if exc.code == ErrorCode.RELOADING else "unreachable"
        if link["state"] == LinkState.RUNNING.value:
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
                **link,
                "pid": handle.pid if handle else None,
                "server_identity": self.server_identity if handle else None,
                "endpoint": handle.endpoint if handle else None,
                "mode": handle.mode if handle else self.launcher.mode,
                "log_path": handle.log_path if handle else None,
                # running and installed versions, reload ability and history (Issue 15)
                **self.upgrade.status(),
                "passthrough": {**self.passthrough_link.snapshot(),
                                "pid": self.passthrough_handle.pid if self.passthrough_handle else None},
            },
            "recovery": {
                "retracked": len(report.retracked),
                "not_retracked": len(report.not_retracked),
                "reasons": dict(report.not_retracked),
                "stopped_orphans": len(report.stopped_orphans),
                "duration_ms": round(report.duration_ms, 1),
            },
            "adoption": {"outcome": report.adoption.outcome, "reason": report.adoption.reason},
            "sandbox": await agent_launch.sandbox_status(self),
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
        workspace = await self._workspace_for(task_id, args.get("workspace"), executor)
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
                if self.passthrough_link.state != LinkState.NONE:  # lost: its link restarts it
                    raise self._no_server(self.passthrough_link)
                self.passthrough_link.attach(await self._start_passthrough_server())
            assert self.passthrough_client is not None
            return self.passthrough_client
        if self.client is None:
            if self.link.state in (LinkState.LOST, LinkState.RESTARTING, LinkState.GAVE_UP):
                raise self._no_server(self.link)
            raise IpcError(ErrorCode.UNAVAILABLE, "the backend has no control server yet; retry shortly", True)
        return self.client

    def git_credentials(self, session_id: str, env: dict[str, str], socket: Path) -> GitCredentials:
        """Issue the session's git credential lease and store the non-secret snapshot, for a launch
        of a session that is already durably STARTING (RESUME-5, RESUME-6, RESUME-9): policy
        ``none`` when the workspace is not GitHub-backed or no upstream token is configured.
        ``socket``: the session's credential endpoint, where the agent's helper redeems it."""
        with self.store.session() as db:
            creds = prepare_git_credentials(db, session_id, paths=self.paths, config=self.config.credentials,
                                            base_env=env, socket=socket)
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
            if task_id in self.deleting_tasks:
                raise IpcError(ErrorCode.CONFLICT, f"task {task_id} is being deleted")
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
        stage = "agent runtime"
        try:
            await runtime_prepare.ensure(self, agent, session_id)  # first use: the runtime job runs first
            command = await agent_launch.agent_command(self, agent)
            stage = "git credentials"
            # A GitHub-backed workspace gets its scoped lease now that STARTING is durable (as a resume does).
            prep = await agent_launch.prepare(self, session_id, command)
            assert prep.credentials is not None
            creds = prep.credentials
            stage = "control server"
            async with self.launch_gate.launch():  # the server is not replaced under a launch
                client = await self._server_for(passthrough)
                handle = self.passthrough_handle if passthrough else self.handle
                assert handle is not None
                stage = "launch"
                info = await client.create_instance(
                    session_id=session_id,
                    task_id=task_id,
                    command=prep.command,
                    cwd=workspace,
                    env=prep.env,
                    agent=agent_name,
                    sandbox=prep.sandbox,
                    secret_env=prep.secret_env,
                )
        except BaseException as exc:
            # Whatever failed after STARTING, the session does not stay STARTING.
            self.endpoints.close_soon(session_id)
            error = exc.to_ipc() if isinstance(exc, CredentialError) else exc
            message = error.message if isinstance(error, IpcError) else (str(error) or type(error).__name__)
            with self.store.session() as db, contextlib.suppress(transitions.TransitionConflict):
                transitions.transition_session(
                    db, session_id, "FAILED", expected_from={"STARTING"}, reason=f"start failed ({stage})",
                    last_error=f"{stage}: {message}",
                )
            if stage == "launch" and isinstance(error, IpcError) and error.code != agent_launch.SANDBOX_UNAVAILABLE:
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

    def _read_session(self, session_id: str, request: PageRequest) -> StoredSession:
        """The store's part of ``session show`` (a worker thread, its own store session)."""
        with self.store.session() as db:
            stored = read_session(db, session_id, request)
        if stored is None:
            raise _not_found("session", session_id)
        return stored

    async def op_session_show(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        session_id = args["session_id"]
        # Transcripts may be huge: read off the loop, one bounded page (daemon.backend.session_view).
        stored = await asyncio.to_thread(self._read_session, session_id, PageRequest.from_args(args))
        ex = self.executions.executions.get(session_id)
        session, row = stored.session, stored.row
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
            # Why its agent was lost, while it has none: a backend restart or a lost control server.
            "interruption": (row.metadata_json or {}).get("interruption") if row is not None and ex is None else None,
            "guard": self.executions.guards.get(session_id),
            "last_error": session.last_error,
            "runtime_config": runtime,
            # the runtime job a first use ran before the agent started (daemon/backend/runtime_prepare.py)
            "runtime_prepare": meta.get(runtime_prepare.PROGRESS_KEY),
            "permissions": stored.permissions,
            "turns": stored.turns,
            "turns_total": stored.turns_total,
            "transcript": stored.transcript,
            "page": stored.page,
        }

    def _read_sessions(self) -> list[tuple[str, str, str]]:
        with self.store.session() as db:
            return [tuple(r) for r in db.execute(
                select(TaskSession.id, TaskSession.task_id, TaskSession.state).order_by(TaskSession.created_at)
            )]

    async def op_session_list(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("detail"):
            return await self.views.session_rows()
        rows = await asyncio.to_thread(self._read_sessions)  # off the loop: every session of the store
        executions = self.executions.executions
        return {
            "sessions": [
                {
                    "session_id": sid,
                    "task_id": task_id,
                    "state": state,
                    "retracked": bool((ex := executions.get(sid)) is not None and ex.retracked),
                }
                for sid, task_id, state in rows
            ]
        }

    def _read_board(self) -> dict[str, list[str]]:
        with self.store.session() as db:
            return board(db)

    async def op_board(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self._read_board)  # off the loop: every task of the store


async def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if predicate():
            return True
        await asyncio.sleep(interval)
    return predicate()
