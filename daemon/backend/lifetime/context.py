"""What every part of the backend shares during one backend lifetime.

``BackendContext`` holds the configuration, the store, the executions this backend tracks and
their event consumer, the control servers it uses (``daemon.backend.control.servers``), the
sessions' credential endpoints, the launch gate and the recovery report. The services
(``sessions``, ``resume``, ``runtime_settings``, ``workflow_runner``, ...) and the handler modules
receive it; the composition root (``daemon.backend.app``) builds it. It imports none of them, so
nothing that uses it forms an import cycle with it.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from pathlib import Path
from typing import Any

from daemon.agentctl.client.connection import AgentctlClient
from daemon.api.ops import BackendState
from daemon.backend.cluster.membership import Cluster
from daemon.backend.control.launcher import ControlServerHandle, Launcher
from daemon.backend.control.link import ControlServerLink
from daemon.backend.control.servers import ControlServers
from daemon.backend.git.credential_endpoints import CredentialEndpoints
from daemon.backend.lifetime.store_care import StoreCare
from daemon.backend.recovery.recovery import RecoveryReport
from daemon.backend.state.executions import EventConsumer, Execution, ExecutionStore
from daemon.backend.state.launch_gate import LaunchGate
from daemon.backend.state.quiet_turns import QuietTurns, note_events
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.lists import Views
from daemon.backend.views.quiet_report import quiet_report
from daemon.config.platform import CapabilityStatus
from daemon.config.settings import Config
from daemon.credentials import GitCredentials, prepare_git_credentials, record_credential_snapshot
from daemon.host.paths import Paths
from daemon.runtimes.update import RuntimeJobs
from daemon.store.db import Store
from daemon.store.states import LaunchMode


class BackendContext:
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
        # Several hosts on one PostgreSQL (Issue 47): who this backend is, the hosts and their heartbeats.
        self.cluster = Cluster.of(config, store, installation_id)
        self.state = BackendState.STARTING
        self.enabled = capability.state == "enabled"
        if self.enabled:
            mode = LaunchMode.UNIT if capability.supervisor == "systemd" else LaunchMode.DETACHED
        else:
            mode = LaunchMode.CHILD
        self.executions = ExecutionStore()
        # Each live session's git credential endpoint: all an agent can reach of the backend.
        self.endpoints = CredentialEndpoints(store, paths.home, config.credentials)
        # The life of each control server (watch, lose, restart, give up): daemon.backend.control.servers.
        self.servers = ControlServers(paths, config, installation_id, mode, store, self.executions,
                                      self.endpoints, self.on_gone)
        # The store's size, free space, retention and vacuum (daemon.backend.lifetime.store_care).
        self.store_care = StoreCare(store, config.store.transcript_retention, paths.home)
        # How long each running turn's agent has been silent (agents.quiet_warning_s, turn_timeout_s):
        # fed every committed batch of events, read by follow, the board, session show and the
        # turn watch (daemon.backend.sessions.turn_watch).
        self.quiet = QuietTurns(time.monotonic, config.agents.quiet_warning_s, config.agents.turn_timeout_s)
        self.consumer = EventConsumer(store, self.servers.client_for, self.on_gone, self.store_care.space,
                                      on_applied=functools.partial(note_events, self.quiet),
                                      reach=self.store_care.reach)
        self.transcripts = TranscriptHub()  # wakes follow streams on store commits
        self.transcripts.observe(store)
        # sessions features.auto_resume is about to resume: not "no agent" on the board meanwhile
        self.auto_resume_pending: set[str] = set()
        self.views = Views(store, self.executions, self.auto_resume_pending, self.quiet_report,
                           self.store_care.space.status, self.cluster)
        self.report = RecoveryReport()
        self.shutdown_requested = asyncio.Event()
        self.stop_agents_at_shutdown = False  # kandev down --agents: the survival server stops them too
        self.socket_path = str(paths.backend_socket)
        # Keeping the control server on the installed version (Issue 15): launches share this gate
        # with a replacement of the server (daemon.backend.lifetime.server_upgrade).
        self.launch_gate = LaunchGate()
        self.deleting_tasks: set[str] = set()  # tasks a task_delete is removing: no new agent for them
        self.runtime_jobs: RuntimeJobs | None = None  # set by runtimes_api.handlers

    def on_gone(self, ex: Execution) -> None:
        """An execution ended (its agent exited, or it is no longer ours)."""
        self.executions.executions.pop(ex.session_id, None)
        self.endpoints.close_soon(ex.session_id)
        self.quiet.forget(ex.session_id)

    def quiet_report(self, session_id: str, agent: str | None) -> dict[str, Any] | None:
        """The session's ``quiet`` object (``daemon.backend.views.quiet_report``): its running turn's
        agent has been silent for ``agents.quiet_warning_s`` or more; None otherwise, or when this
        backend does not track its agent. Read on the event loop."""
        if session_id not in self.executions.executions:
            return None
        return quiet_report(self.quiet.quiet(session_id), session_id, agent, self.config.agents.settings)

    # The survival and passthrough servers' parts, as the rest of the backend reads them.
    @property
    def client(self) -> AgentctlClient | None:
        return self.servers.survival.client

    @property
    def handle(self) -> ControlServerHandle | None:
        return self.servers.survival.handle

    @property
    def passthrough_client(self) -> AgentctlClient | None:
        return self.servers.passthrough.client

    @property
    def passthrough_handle(self) -> ControlServerHandle | None:
        return self.servers.passthrough.handle

    @property
    def link(self) -> ControlServerLink:
        return self.servers.survival.link

    @property
    def passthrough_link(self) -> ControlServerLink:
        return self.servers.passthrough.link

    @property
    def launcher(self) -> Launcher:
        return self.servers.survival.launcher

    @property
    def claim_tasks(self) -> dict[str, asyncio.Task[None]]:
        return self.servers.claim_tasks

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
