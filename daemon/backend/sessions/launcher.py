"""The one launch pipeline of the backend: how a session gets an agent.

Session start (``daemon.backend.sessions.sessions``), resume (``daemon.backend.sessions.resume``) and a context reset
that restarts the agent (``daemon.backend.sessions.context_reset``) all go through ``SessionLauncher``, in
this order; each caller has already made STARTING durable (the credential broker issues a lease
only for a session that is STARTING, and a failure must find a STARTING to leave):

1. **credentials** (``launch``): the agent's command, the session's directories, a new git lease
   (start, resume) or the lease the running agent already holds (restart-reset keeps it), the
   environment and the sandbox request (``daemon.backend.sessions.agent_launch``);
2. **create_instance** (``launch``): on the session's control server (survival or passthrough),
   under the launch gate so the server is not replaced under a launch; a restart-reset stops its
   old instance under the same gate, after the sandbox check, so the agent is never stopped for a
   launch the server would refuse;
3. **inventory row** (``record_live``): the ``executors_running`` row names the new live instance;
4. **WAITING_FOR_INPUT** (``ready``): the session is ready and its task in review, in the same
   store transaction as the row (a context reset announces it only once restore succeeded);
5. the execution is tracked and its events consumed (``track``).

What a caller does when a step fails (FAILED, the prior state, WAITING_FOR_INPUT again) is the
caller's: the pipeline only says which stage it was in (``LaunchProgress``) and undoes what it
started (``abandon``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.replies import CreatedInstance
from daemon.agents.registry import BuiltinAgent
from daemon.backend.sessions import agent_launch, runtime_prepare
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.executions import Execution
from daemon.config.settings import agent_memory_bound
from daemon.credentials import GitCredentials
from daemon.host.agent_user import check_workspace
from daemon.store import transitions
from daemon.store.models import ExecutorRunning
from daemon.store.states import SessionState, TaskState

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext


def _now() -> datetime:
    return datetime.now(UTC)


class LaunchStage(StrEnum):
    """Where a launch was when it failed (a session start names it in ``last_error``)."""

    AGENT_RUNTIME = "agent runtime"
    CREDENTIALS = "git credentials"
    CONTROL_SERVER = "control server"
    LAUNCH = "launch"


@dataclass
class LaunchProgress:
    stage: LaunchStage = LaunchStage.AGENT_RUNTIME


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of one session's agent."""

    session_id: str
    task_id: str
    agent: BuiltinAgent
    agent_name: str  # as the session stores it
    workspace: str
    executor: str
    passthrough: bool
    resume_token: str | None = None  # ACP session/load of this provider session; None: session/new
    # None: a new git lease (start, resume). True/False: a relaunch that keeps what the running agent
    # had, with (True) or without its current lease file (restart-reset, RESETCFG-13).
    keep_lease: bool | None = None
    # A relaunch: the instance stopped under the same gate, just before the new one is created, and
    # the client of the server it runs on.
    replaces: str | None = None
    client: AgentctlClient | None = None


@dataclass
class Launched:
    """A created instance: the control server's answer and where it runs."""

    plan: LaunchPlan
    info: CreatedInstance
    endpoint: str
    credentials: GitCredentials | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def instance_id(self) -> str:
        return self.info["instance_id"]

    @property
    def acp_session_id(self) -> str | None:
        return self.info.get("acp_session_id")

    @property
    def handshake_seq(self) -> int:
        return int(self.info.get("handshake_seq") or 0)


class SessionLauncher:
    """Steps 1-5 of the module docstring, for one backend."""

    def __init__(self, backend: BackendContext) -> None:
        self.backend = backend

    async def launch(self, plan: LaunchPlan, progress: LaunchProgress | None = None,
                     before_create: Callable[[], Awaitable[None]] | None = None) -> Launched:
        """Credentials, then ``create_instance``. ``before_create`` runs between the two (a
        restart-reset lets the old agent's events drain and stops consuming them there)."""
        b = self.backend
        progress = progress or LaunchProgress()
        # the agent's uid must be able to write its workspace (never re-owned for it: refused)
        await asyncio.to_thread(check_workspace, plan.workspace)
        progress.stage = LaunchStage.AGENT_RUNTIME
        if plan.keep_lease is None:
            await runtime_prepare.ensure(b, plan.agent, plan.session_id)  # first use: the runtime job runs first
            command = await agent_launch.agent_command(b, plan.agent)
            progress.stage = LaunchStage.CREDENTIALS
            # A new lease: the session is durably STARTING (RESUME-9).
            prep = await agent_launch.prepare(b, plan.session_id, command)
        else:
            prep = await agent_launch.prepare_relaunch(b, plan.session_id, plan.agent, with_lease=plan.keep_lease)
        if before_create is not None:
            await before_create()
        progress.stage = LaunchStage.CONTROL_SERVER
        async with b.launch_gate.launch():  # the server is not replaced under a launch
            client = plan.client if plan.client is not None else await b.servers.server_for(plan.passthrough)
            handle = b.servers.handle_of(plan.passthrough)
            progress.stage = LaunchStage.LAUNCH
            if plan.replaces is not None:
                client.check_sandbox(prep.sandbox)  # refused before the agent is stopped, not after
                client.check_secret_env(prep.secret_env)
                client.check_network(prep.network)
                await client.stop_instance(plan.replaces)
            info = await client.create_instance(
                session_id=plan.session_id, task_id=plan.task_id, command=prep.command, cwd=plan.workspace,
                env=prep.env, agent=plan.agent_name, resume_session_id=plan.resume_token, sandbox=prep.sandbox,
                secret_env=prep.secret_env, max_memory=agent_memory_bound(b.config, plan.agent_name),
                network=prep.network,
            )
        endpoint = handle.endpoint if handle is not None else ""
        return Launched(plan, info, endpoint, prep.credentials)

    def record_live(self, db: Any, launched: Launched, *, last_event_seq: int, in_place: bool = False) -> None:
        """Step 3: the inventory row names the new live instance. ``in_place``: a relaunch updates
        the row the session already has (its token and paths stay), and writes none if it has none."""
        plan, info = launched.plan, launched.info
        if in_place:
            row = db.get(ExecutorRunning, plan.session_id)
            if row is None:
                return
            row.instance_id = info["instance_id"]
            AgentIdentity.reported(info).record(row)
            row.endpoint = launched.endpoint or row.endpoint
            row.last_event_seq = last_event_seq
            row.created_by_boot = self.backend.boot_id
            row.status = "live"
            row.updated_at = _now()
            return
        row = ExecutorRunning(
            session_id=plan.session_id, task_id=plan.task_id, instance_id=info["instance_id"],
            endpoint=launched.endpoint, resume_token=info.get("acp_session_id"),
            worktree_path=plan.workspace if plan.executor == "worktree" else None,
            workspace_path=plan.workspace, runtime="standalone", agent_profile=plan.agent_name, status="live",
            last_event_seq=last_event_seq, created_by_boot=self.backend.boot_id, metadata_json={},
            created_at=_now(), updated_at=_now(),
        )
        AgentIdentity.reported(info).record(row)
        db.merge(row)

    @staticmethod
    def ready(db: Any, session_id: str, task_id: str, reason: str, *, task_review: bool = True,
              **fields: Any) -> None:
        """Step 4: STARTING -> WAITING_FOR_INPUT (``fields``: ``metadata_json``, ``last_error``) and
        the task in review. A competing transition that won raises ``TransitionConflict``."""
        transitions.transition_session(db, session_id, SessionState.WAITING_FOR_INPUT, expected_from={SessionState.STARTING},
                                       reason=reason, **fields)
        if task_review:
            transitions.set_task_state(db, task_id, TaskState.REVIEW)

    def track(self, launched: Launched, *, last_seq: int = 0) -> Execution:
        """Step 5: the execution is this backend's, its events consumed."""
        plan, info = launched.plan, launched.info
        ex = Execution(
            session_id=plan.session_id, task_id=plan.task_id, instance_id=info["instance_id"],
            agent=AgentIdentity.reported(info), acp_session_id=info.get("acp_session_id"),
            passthrough=plan.passthrough, last_seq=last_seq,
        )
        self.backend.executions.executions[plan.session_id] = ex
        self.backend.consumer.start(ex)
        return ex

    async def abandon(self, session_id: str, passthrough: bool, instance_id: str | None = None) -> None:
        """Undo a launch that failed: its instance (if any) stops, its credential endpoint closes."""
        client = self.backend.servers.client_of(passthrough) if instance_id else None
        if instance_id and client is not None:
            with contextlib.suppress(Exception):
                await client.stop_instance(instance_id)
        self.backend.endpoints.close_soon(session_id)
