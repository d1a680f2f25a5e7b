"""The control server's composition root: what one launch is made of, wired together.

``daemon.agentctl.main`` builds an ``AgentctlServer`` (or ``from_handover`` after a re-exec),
``start``s it and, at the end, ``shutdown``s it. Everything else lives in a module with one job:

- shared state: ``server_context.ServerContext`` (identity, settings, ``Ownership``, the table of
  instances, turn ids, the exit request, the reload history);
- services: ``connection_auth`` (which connection may do what), ``instances`` (create, stop, the
  agents' log bounds), ``sandbox_host`` (can agents be sandboxed here, and how),
  ``reload_status`` (``server_info`` and the status file); one agent is
  ``daemon.agentctl.instance.instance``;
- handler modules, one per area, that read the request, call a service and shape the answer:
  ``ownership_api`` (docs/architecture.md#ownership), ``instances_api``, ``events_api``,
  ``reload_api`` (Issue 15).

This module keeps the launch's own lifecycle: the listener, the unowned timer
(AC-EXECUTORS-CONTROL-OWNERSHIP-003.1: ``now - last_renewal >= period`` latches the shutdown and
asks the process to exit), the shutdown, and the server's side of a re-exec's hand-over
(``capture_handover`` / ``from_handover`` / ``start_handed_over``; daemon.agentctl.reload.reexec).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import daemon.agentctl.api.events as events_api
import daemon.agentctl.api.instances as instances_api
import daemon.agentctl.api.ownership as ownership_api
import daemon.agentctl.api.reload as reload_api
from daemon.agentctl.connection_auth import ConnectionAuth, authenticated
from daemon.agentctl.egress.host import EgressHost
from daemon.agentctl.handover import HANDOVER_FORMAT, ReloadHistory, ServerHandover, to_plain
from daemon.agentctl.instance import stderr_drain
from daemon.agentctl.instance.conversation import TurnIds
from daemon.agentctl.instance.instance import Instance
from daemon.agentctl.instances import InstanceService
from daemon.agentctl.launch import LaunchConfig
from daemon.agentctl.ownership import Ownership
from daemon.agentctl.protocol import TABLE
from daemon.agentctl.reload import instance_handover
from daemon.agentctl.reload import status as reload_status
from daemon.agentctl.sandbox.bubblewrap import SandboxSupport
from daemon.agentctl.sandbox_host import SandboxHost
from daemon.agentctl.server_context import ServerContext
from daemon.config.agentctl import ResolvedAgentctl
from daemon.core.journal import log_event
from daemon.core.limits import BUFFER_LIMIT, IDLE_CONNECTION_TIMEOUT_S, connection_limit
from daemon.core.version import VERSION
from ipc.connection import ConnectionContext
from ipc.server import Handler, IpcServer

log = logging.getLogger("kandev.agentctl.server")


class AgentctlServer:
    """One launch: its shared state, its services, its handler table and its listener."""

    def __init__(
        self,
        config: LaunchConfig,
        resolved: ResolvedAgentctl,
        credential: bytes,
        *,
        on_instances_changed: Callable[[int], None] | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.context = ctx = ServerContext(config, resolved, credential, on_instances_changed=on_instances_changed,
                                           handshake_timeout=handshake_timeout)
        self.auth = ConnectionAuth(ctx)
        self.sandbox = SandboxHost(ctx)
        self.egress = EgressHost(os.path.dirname(config.socket_path))
        self.instance_service = InstanceService(ctx, self.sandbox, self.egress)
        handlers = {name: self._logged(name, handler) for name, handler in self.handlers().items()}
        self.ipc = ctx.ipc = IpcServer(
            config.socket_path, TABLE, handlers, authorize=self.auth.authorize, max_connections=connection_limit(),
            # The owner's authenticated connections (calls, claims, streams) may idle; nobody else's.
            idle_timeout=IDLE_CONNECTION_TIMEOUT_S, idle_exempt=authenticated, buffer_limit=BUFFER_LIMIT,
            on_disconnect=self._log_closed,
        )

    def handlers(self) -> dict[str, Handler]:
        """Every op of ``protocol.TABLE``, by area."""
        ctx = self.context
        return {
            **ownership_api.handlers(ctx, self.auth, self.instance_service),
            **instances_api.handlers(ctx, self.instance_service, self.sandbox, self.egress),
            **events_api.handlers(ctx),
            **reload_api.handlers(ctx),
        }

    def _logged(self, name: str, handler: Handler) -> Handler:
        """``handler`` with its op logged at debug level first; a plain handler stays plain (the
        ipc server answers those inline)."""
        if not inspect.iscoroutinefunction(handler):
            def run_now(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
                log.debug("conn %d (pid %d) op %s", self.context.conn_id(ctx), ctx.peer.pid, name)
                return handler(ctx, args)

            return run_now

        async def run(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            log.debug("conn %d (pid %d) op %s", self.context.conn_id(ctx), ctx.peer.pid, name)
            return await handler(ctx, args)

        return run

    def _log_closed(self, ctx: ConnectionContext) -> None:
        """The end of a connection that sent an op, in the debug log next to its ops."""
        conn_id = ctx.state.get("conn_id")
        if conn_id is not None:
            log.debug("conn %d (pid %d) closed", conn_id, ctx.peer.pid)

    # -- what main, the reloader and the preflight read --------------------------

    @property
    def server_identity(self) -> str:
        return self.context.server_identity

    @property
    def instances(self) -> dict[str, Instance]:
        return self.context.instances

    @property
    def shutting_down(self) -> bool:
        """The one-way latch (AC-EXECUTORS-CONTROL-OWNERSHIP-003.9): set by the unowned decision, ownership_shutdown or a signal."""
        return self.context.shutting_down

    @property
    def unowned_period_s(self) -> float:
        return self.context.unowned_period_s

    @property
    def detached_event_limit(self) -> int:
        return self.context.detached_event_limit

    @property
    def exit_requested(self) -> asyncio.Event:
        return self.context.exit_requested

    @property
    def exit_reason(self) -> str | None:
        return self.context.exit_reason

    @property
    def reload_history(self) -> ReloadHistory:
        return self.context.reload_history

    @property
    def background_io(self) -> asyncio.Lock:
        return self.context.background_io

    @property
    def reloader(self) -> Any:
        return self.context.reloader

    @reloader.setter
    def reloader(self, reloader: Any) -> None:
        self.context.reloader = reloader

    @property
    def sandbox_support(self) -> SandboxSupport | None:
        return self.sandbox.support

    def write_reload_status(self) -> None:
        reload_status.write(self.context)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        await self.sandbox.probe()
        self.sandbox.probe_memory()
        self.sandbox.prune_memory()
        await asyncio.to_thread(self.egress.prune, set())
        await self.ipc.start()
        self.write_reload_status()
        self.context.spawn_background(self.run_unowned_timer())
        self.context.spawn_background(self.instance_service.run_agent_log_bounds())

    async def run_unowned_timer(self, interval: float = 1.0) -> None:
        """Check the unowned period about every ``interval`` s; on expiry latch and request the exit."""
        ctx = self.context
        while True:
            if ctx.ownership.decide_unowned_shutdown():
                idle = time.monotonic() - ctx.ownership.last_renewal
                log_event(
                    "unowned_shutdown",
                    f"control server {ctx.server_identity}: no ownership renewal for {idle:.1f} s"
                    f" (unowned period {ctx.unowned_period_s:g} s): stopping {len(ctx.instances)}"
                    " instance(s) and exiting",
                    priority=4,
                    SERVER_IDENTITY=ctx.server_identity,
                    UNOWNED_PERIOD_S=f"{ctx.unowned_period_s:g}",
                    INSTANCES=len(ctx.instances),
                )
                ctx.request_exit("unowned_shutdown")
                return
            if ctx.shutting_down:
                return
            await asyncio.sleep(min(interval, max(ctx.ownership.remaining(), 0.01)))

    async def shutdown(self) -> list[str]:
        """Stop everything and close the socket (SIGTERM/SIGINT, ownership_shutdown, unowned shutdown)."""
        ctx = self.context
        ctx.ownership.begin_shutdown(ctx.exit_reason or "signal")
        stopped = await self.instance_service.stop_all()
        # An ownership_shutdown that arrived while stopping ("already stopping" counts as success)
        # gets to send its reply before the socket closes.
        deadline = time.monotonic() + ownership_api.SHUTDOWN_REPLY_GRACE
        while ctx.shutdown_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.ipc.close()
        await self.egress.close_all()
        with contextlib.suppress(OSError):
            reload_status.status_path(ctx).unlink()
        ctx.cancel_background()
        return stopped

    # -- re-exec hand-over (daemon.agentctl.reload.reexec captures, daemon.agentctl.reload.resume restores) ------

    def capture_handover(self, *, listen_fd: int, quiesced_at: float, attempt: int) -> ServerHandover:
        """The whole server, for the next process image (synchronous: nothing moves meanwhile)."""
        ctx = self.context
        identity = self.ipc.identity
        history = ReloadHistory(**to_plain(ctx.reload_history))
        for inst in ctx.instances.values():  # the refusals so far travel in each spec
            self.egress.sync(inst.instance_id, inst.spec.network)
        history.last_attempt = attempt
        return ServerHandover(
            format=HANDOVER_FORMAT,
            from_version=VERSION,
            pid=os.getpid(),
            server_identity=ctx.server_identity,
            launch=to_plain(ctx.config),
            unowned_period_s=ctx.unowned_period_s,
            detached_event_limit=ctx.detached_event_limit,
            turn_counter=ctx.turn_ids.counter,
            listen_fd=listen_fd,
            socket_path=self.ipc.path,
            socket_identity=list(identity) if identity is not None else [],
            ownership=ctx.ownership.snapshot(),
            reload=history,
            instances=[instance_handover.capture(inst) for inst in ctx.instances.values()],
            quiesced_at=quiesced_at,
            sandbox_support=self.sandbox.support,
        )

    @classmethod
    def from_handover(
        cls,
        state: ServerHandover,
        config: LaunchConfig,
        resolved: ResolvedAgentctl,
        *,
        on_instances_changed: Callable[[int], None] | None = None,
    ) -> AgentctlServer:
        """The server of the previous process image, instances included (pipes not yet taken
        back: ``start_handed_over``)."""
        ownership = Ownership.from_snapshot(state.ownership, clock=time.monotonic)
        server = cls(config, resolved, ownership.current_credential(),
                     on_instances_changed=on_instances_changed)
        ctx = server.context
        ctx.server_identity = state.server_identity
        ctx.ownership = ownership
        ctx.turn_ids = TurnIds(state.server_identity, state.turn_counter)
        ctx.reload_history = state.reload
        # The previous image's probe answered for what that code's sandbox needed (0.2.0's had no
        # IPC namespace) under the restrictions of the unit this process started with: kept only
        # until this image's own probe, started at once by start_handed_over, replaces it.
        server.sandbox.support = state.sandbox_support
        memory = server.sandbox.probe_memory()  # this image's own: where the previous one put its agents
        for h in state.instances:
            inst = instance_handover.restore(h, agent_log_dir=Path(config.agent_log_dir), turn_ids=ctx.turn_ids,
                                             on_change=ctx.changed)
            instance_handover.restore_memory(inst, memory)
            ctx.instances[inst.instance_id] = inst
        return server

    async def start_handed_over(self, state: ServerHandover, listener: Any) -> None:
        """Take the agents' pipes back, then serve on the inherited listening socket."""
        ctx = self.context
        for inst, h in zip(list(ctx.instances.values()), state.instances, strict=True):
            try:
                await instance_handover.resume_pipes(inst, h)
            except Exception as exc:  # one instance's pipes never cost the others theirs
                log.exception("instance %s: cannot take its agent's pipes back", inst.instance_id)
                inst.not_taken_over.append(f"the agent's pipes ({type(exc).__name__}: {exc}); the agent still"
                                           " runs and stop_instance ends it")
            if inst.memory is not None and not inst.exited.is_set():
                inst.memory.watch()  # v1: this image's own notification of the agent's cgroup running out
        for inst in list(ctx.instances.values()):  # each agent's way out, at the path its sandbox binds
            await self.egress.restore(inst.instance_id, inst.spec.session_id, inst.spec.agent, inst.spec.network)
            self.egress.log_to(inst.instance_id, functools.partial(_note, inst))
        identity = state.socket_identity
        await self.ipc.start_on(listener, (identity[0], identity[1]) if len(identity) == 2 else None)
        ctx.spawn_background(self.run_unowned_timer())
        ctx.spawn_background(self.instance_service.run_agent_log_bounds())
        ctx.spawn_background(self.sandbox.probe())  # what this code's sandbox needs, under this unit
        ctx.changed()


def _note(inst: Instance, line: str) -> None:
    """A line of kandev's own among ``inst``'s agent's stderr (its refusals, ``kandev logs``)."""
    stderr_drain.note_line(inst.stderr_sink, line)
