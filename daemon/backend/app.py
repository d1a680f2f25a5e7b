"""The backend's composition root: what one backend process is made of, wired together.

``daemon.backend.main`` builds a ``Backend`` in the startup order, serves ``api.TABLE`` with
``handlers()``, runs ``recover()`` and, at the end, ``shutdown()``. Everything else lives in a
module with one job:

- shared state: ``context.BackendContext`` (configuration, store, executions, endpoints) and
  ``control_servers.ControlServers`` (the survival and passthrough control servers, their links
  and ownership claims);
- services: ``tasks``, ``sessions``, ``session_launcher`` (the one launch pipeline of start,
  resume and restart-reset), ``resume``, ``runtime_settings``, ``context_reset``,
  ``workflow_runner``, ``server_upgrade``;
- handler modules, one per area, that read the request, call a service and map its errors:
  ``tasks_api``, ``sessions_api``, ``resume_api``, ``runtime_config_api``, ``workflow_api``,
  ``credentials_api``, ``runtimes_api``, ``status_api``, ``views``, ``follow``.
"""

from __future__ import annotations

import asyncio
import contextlib

import daemon.backend.handlers.credentials as credentials_api
import daemon.backend.handlers.hosts as hosts_api
import daemon.backend.handlers.resume as resume_api
import daemon.backend.handlers.runtime_config as runtime_config_api
import daemon.backend.handlers.runtimes as runtimes_api
import daemon.backend.handlers.sessions as sessions_api
import daemon.backend.handlers.status as status_api
import daemon.backend.handlers.tasks as tasks_api
import daemon.backend.handlers.workflow as workflow_api
import daemon.backend.lifetime.hygiene as hygiene
import daemon.backend.sessions.lifecycle as lifecycle
import daemon.backend.tasks.delete as task_delete
import daemon.backend.views.ids as ids
from daemon.api.ops import TABLE, AdoptionOutcome, BackendState
from daemon.backend.cluster.membership import Cluster
from daemon.backend.cluster.messaging import ClusterMessaging, refuse_hosts
from daemon.backend.cluster.own_sessions import own_sessions_only
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.lifetime.server_upgrade import ServerUpgrade
from daemon.backend.recovery.adoption import Adopter
from daemon.backend.recovery.recovery import Recovery, RecoveryReport
from daemon.backend.sessions import agent_launch
from daemon.backend.sessions.context_reset import ContextReset
from daemon.backend.sessions.launcher import SessionLauncher
from daemon.backend.sessions.live import LiveSessions
from daemon.backend.sessions.resume import ResumeService
from daemon.backend.sessions.runtime_settings import RuntimeSettings
from daemon.backend.sessions.sessions import SessionService
from daemon.backend.sessions.turn_watch import TurnWatch
from daemon.backend.sessions.workflow_runner import WorkflowRunner
from daemon.backend.state.executions import Execution
from daemon.backend.tasks.tasks import TaskService
from daemon.backend.views.follow import FollowService
from daemon.config.platform import CapabilityStatus
from daemon.config.settings import Config
from daemon.core.journal import log_event
from daemon.host.paths import Paths
from daemon.store.db import Store
from ipc.server import Handler


class Backend:
    """One backend process lifetime: its shared state, its services and its handler table."""

    def __init__(
        self,
        paths: Paths,
        config: Config,
        capability: CapabilityStatus,
        store: Store,
        installation_id: str,
    ) -> None:
        self.context = ctx = BackendContext(paths, config, capability, store, installation_id)
        # Keeping the control server on the installed version (Issue 15): reload or replace-when-idle.
        self.upgrade = ServerUpgrade(ctx)
        self.launcher = SessionLauncher(ctx)
        self.tasks = TaskService(store, paths, lambda: ctx.config,
                                 lambda: agent_launch.hidden_paths(ctx.config, ctx.paths))
        self.sessions = SessionService(ctx, self.launcher)
        self.live = LiveSessions(ctx)
        self.resume = ResumeService(ctx, self.launcher, self.live)
        self.settings = RuntimeSettings(ctx, self.live)
        self.resets = ContextReset(ctx, self.launcher, self.live)
        self.workflow = WorkflowRunner(ctx, self.sessions, self.resets)
        # Silent turns: warned about, and ended with reason timeout (agents.turn_timeout_s).
        self._heartbeats: asyncio.Task[None] | None = None  # cluster mode: daemon.backend.cluster.membership
        self.turn_watch = TurnWatch(ctx.quiet, ctx.executions, store, ctx.transcripts, self.sessions.cancel,
                                    config.agents.turn_timeout_s,
                                    stop=lambda session_id, by: lifecycle.stop_session(ctx, session_id, by=by))
        # Several hosts (Issue 47): ops on another host's sessions go to it through the store.
        self.messaging: ClusterMessaging | None = None
        if ctx.cluster.identity.host is not None:
            self.messaging = ClusterMessaging(store, ctx.cluster.identity.host, ctx.cluster.directory.reachability,
                                              ctx.transcripts)

    # What daemon.backend.main reads.
    @property
    def config(self) -> Config:
        return self.context.config

    @property
    def cluster(self) -> Cluster:
        return self.context.cluster

    @property
    def capability(self) -> CapabilityStatus:
        return self.context.capability

    @property
    def report(self) -> RecoveryReport:
        return self.context.report

    @property
    def shutdown_requested(self) -> asyncio.Event:
        return self.context.shutdown_requested

    def handlers(self) -> dict[str, Handler]:
        """The op table; also arms automatic resume (it waits for the end of startup recovery)."""
        ctx = self.context
        self.resume.arm_auto_resume()
        # the backend asks it to resume what a lost control server interrupted
        ctx.servers.on_restarted = self.resume.resume_interrupted
        # Every op that takes a task or session id also takes a unique prefix of it (daemon.backend.views.ids).
        # In a cluster, an op that drives another host's session goes to that host through the store
        # (daemon.backend.cluster.router); own_sessions_only, under it, refuses whatever would still
        # drive another host's agent here. Ids resolve first, so both see whole ids.
        table = own_sessions_only(ctx.cluster, ctx.store, {
            **(status := status_api.handlers(ctx, self.upgrade)),
            **hosts_api.handlers(ctx, status["status"]),  # and status's cluster part
            **tasks_api.handlers(self.tasks),
            **task_delete.handlers(ctx),
            **lifecycle.handlers(ctx),
            **sessions_api.handlers(self.sessions),
            # Handler tables of later features register here, one line each.
            **credentials_api.handlers(ctx),
            **resume_api.handlers(self.resume),
            **runtime_config_api.handlers(self.settings, self.resets),
            **workflow_api.handlers(self.workflow),
            **runtimes_api.handlers(ctx),
            **ctx.views.handlers(),
            **FollowService(ctx.store, ctx.transcripts, ctx.executions, ctx.quiet, ctx.quiet_report,
                            ctx.store_care.reach, host=ctx.cluster.identity.host).handlers(),
        })
        # A store that fails (full, or its server unreachable) gets a typed error, prefixes included.
        if self.messaging is None:
            return status_api.store_faults_reported(ctx, ids.resolving(TABLE, ctx.store, refuse_hosts(table)))
        # The runner carries out other hosts' requests through this same table (Issue 47 item 6).
        served = status_api.store_faults_reported(ctx, ids.resolving(TABLE, ctx.store, self.messaging.wrap(table)))
        self.messaging.use(served)
        return served

    async def recover(self) -> None:
        ctx = self.context
        ctx.state = BackendState.RECOVERING
        if ctx.cluster.identity.enabled:  # heard from while recovery runs (it may take its whole deadline)
            self._heartbeats = asyncio.create_task(ctx.cluster.directory.run_heartbeats(), name="cluster-heartbeat")
        if self.messaging is not None:
            self.messaging.start()  # results of requests and other hosts' transcripts wake us from now on
        agentctl = ctx.config.agentctl
        adopter = Adopter(
            ctx.store,
            ctx.paths,
            ctx.installation_id,
            read_timeout_s=agentctl.recovery_read_timeout,
            read_retries=agentctl.recovery_read_retries,
            on_claim_ready=ctx.servers.on_adopted,
            identity=ctx.cluster.identity,
        )
        recovery = Recovery(
            ctx.store,
            ctx.executions,
            adopter,
            deadline_s=agentctl.recovery_deadline,
            read_timeout_s=agentctl.recovery_read_timeout,
            read_retries=agentctl.recovery_read_retries,
            boot_id=ctx.boot_id,
        )
        report, client = await recovery.recover(
            enabled=ctx.enabled, start_own_server=ctx.servers.first_server, publish=self._publish
        )
        report.stopped_with_backend = await asyncio.to_thread(lifecycle.take_clean_stops, ctx.store,
                                                              ctx.cluster.identity)
        ctx.report = report
        adopted = report.adoption.record if report.adoption.outcome == AdoptionOutcome.ADOPTED else None
        ctx.servers.use(client, adopted)
        # A re-tracked agent's open turn is silent from now until its agent says something (read
        # before its events are consumed again: an end among them is not overtaken).
        open_turns = await asyncio.to_thread(self.sessions.open_turns, list(ctx.executions.executions))
        for session_id, turn_id in open_turns.items():
            ctx.quiet.started(session_id, turn_id)
        for ex in list(ctx.executions.executions.values()):
            if ex.consumer is None:
                ctx.consumer.start(ex)
        ctx.servers.watch()
        ctx.store_care.start()
        self.turn_watch.start()
        # A re-tracked agent's sandbox still has its endpoint's directory: serve a new socket there.
        await ctx.endpoints.reopen_for(list(ctx.executions.executions))
        await hygiene.tidy_home_async(ctx)
        if ctx.config.features.auto_resume:  # the board shows them as waiting, not "no agent", meanwhile
            ctx.auto_resume_pending.update(self.resume.interrupted_sessions())
        ctx.state = BackendState.READY
        self.upgrade.start()
        if self.messaging is not None:
            await self.messaging.serve_requests()  # other hosts' requests, those written meanwhile first

    async def _stop_heartbeats(self) -> None:
        """A cluster host's clean stop: no more heartbeats, and ``stopped`` in the hosts' table."""
        if self._heartbeats is None:
            return
        self._heartbeats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._heartbeats
        self._heartbeats = None
        try:
            await asyncio.to_thread(self.context.cluster.directory.stop)
        except Exception as exc:  # the database is unreachable: the others will see this host unreachable
            log_event("cluster_stop_unrecorded", f"the clean stop of this host could not be recorded: {exc}",
                      priority=4)

    def _publish(self, ex: Execution) -> None:
        self.context.executions.executions[ex.session_id] = ex

    async def shutdown(self) -> None:
        """Graceful stop. Enabled: detach, send no stop (AC-EXECUTORS-SURVIVAL-001.1), unless asked to
        stop the agents too (kandev down --agents). Disabled: stop it all. Sessions whose agents
        stop with the backend are recorded as stopped cleanly, so the next start has nothing to
        re-track for them (information, not a warning)."""
        ctx = self.context
        ctx.state = BackendState.STOPPING
        if self.messaging is not None:
            await self.messaging.stop()  # what it still runs for other hosts is answered request_interrupted
        stopping = lifecycle.stopping_with_backend(ctx)  # before the executions are dropped
        await self.upgrade.stop()  # no replacement of an old server starts or goes on now
        await self.turn_watch.stop()  # no silent turn is cancelled now
        await ctx.servers.close()  # what follows is no loss; no claim renewed
        tracked = list(ctx.executions.executions.values())
        await ctx.consumer.stop(tracked)
        detach = ctx.enabled and not ctx.stop_agents_at_shutdown
        if ctx.enabled and ctx.stop_agents_at_shutdown:
            await ctx.servers.stop_survival_server()
        await ctx.servers.disconnect()
        await ctx.store_care.stop()
        await ctx.endpoints.close_all()
        await self._stop_heartbeats()
        stopped = {ex.session_id: stopping.get(ex.session_id) or lifecycle.clean_stop_why(
            survival=ctx.capability.state, survival_reason=ctx.capability.reason, passthrough=ex.passthrough,
            agents_asked=ctx.stop_agents_at_shutdown) for ex in tracked if ex.passthrough or not detach}
        await asyncio.to_thread(lifecycle.record_clean_stop, ctx.store, stopped)
        log_event(
            "backend_stopped",
            "backend stopped; " + ("agents left running (survival enabled)" if detach else "agents stopped")
            + f"; {len(stopped)} session(s) wait for input without an agent",
            DETACHED=int(detach), STOPPED_SESSIONS=len(stopped),
        )
