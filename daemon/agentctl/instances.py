"""The launch's instances as a service: create one (secrets, sandbox, memory cgroup, start), stop one or all,
and keep the agents' stderr files bounded.

``InstanceService`` owns the life of the table ``ServerContext.instances`` from outside an
instance: what goes into a new instance's spec besides the request (its secret values, read off
the loop by ``daemon.agentctl.sandbox.agent_env``; its sandboxed argv from ``SandboxHost``; its
memory cgroup below the one ``SandboxHost.memory`` names, ``daemon.agentctl.instance.memory``), the
``agent_unsandboxed`` / ``instance_started`` journal entries, the clean-up of an instance that
failed to start, and the bounds of ``daemon.agentctl.instance.logs``. What one instance does once
created is ``daemon.agentctl.instance.instance``'s; reading the request off the wire is
``daemon.agentctl.api.instances``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from daemon.agentctl.egress.host import EgressHost
from daemon.agentctl.instance import logs as agent_logs
from daemon.agentctl.instance import stderr_drain
from daemon.agentctl.instance.instance import Instance
from daemon.agentctl.instance.memory import AgentMemory
from daemon.agentctl.instance.process import InstanceSpec, close_launch_fds
from daemon.agentctl.sandbox import agent_env, network
from daemon.agentctl.sandbox import bubblewrap as sandbox
from daemon.agentctl.sandbox.bubblewrap import SandboxPolicy, SandboxRequest
from daemon.agentctl.sandbox_host import SandboxHost
from daemon.agentctl.server_context import ServerContext
from daemon.agents.network import NetworkPolicy, RuleError
from daemon.agents.settings import SettingsError
from daemon.core.journal import log_event
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.agentctl.server")


class InstanceService:
    """Creating and stopping the launch's instances (see the module docstring)."""

    def __init__(self, server: ServerContext, sandbox_host: SandboxHost, egress: EgressHost) -> None:
        self.server = server
        self.sandbox = sandbox_host
        self.egress = egress
        self._stopping: asyncio.Future[list[str]] | None = None  # stop_all's one stop

    async def create(self, spec: InstanceSpec, sandbox_wire: Any, secret_refs: Any,
                     max_memory: int | None = None, network_wire: Any = None) -> Instance:
        """Start the agent ``spec`` asks for, in its sandbox unless the request's ``sandbox``
        says off, in its own network namespace with its egress proxy (``network_wire``, the policy),
        in a memory cgroup of its own bounded to ``max_memory`` bytes where this server can make one;
        the instance is in the table and running on return."""
        try:
            policy = self.egress.policy(spec.agent, network_wire)
        except RuleError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"create_instance: {exc}") from None
        try:
            return await self._create(spec, sandbox_wire, secret_refs, policy, max_memory)
        except BaseException:
            await self.egress.close(spec.instance_id)
            raise

    async def _create(self, spec: InstanceSpec, sandbox_wire: Any, secret_refs: Any, policy: NetworkPolicy,
                      max_memory: int | None) -> Instance:
        server = self.server
        spec.secret_env = await self._agent_secrets(spec.agent, secret_refs)
        request = SandboxRequest.from_wire(sandbox_wire)
        if request.policy is SandboxPolicy.REQUIRED:
            request = agent_env.hide_secret_files(request, server.config.secret_refs(), secret_refs)
            socket_path = await self._open_egress(spec, policy)
            if socket_path is not None:  # its directory, read-only: the relay inside connects to it
                request = dataclasses.replace(request, readonly=(*request.readonly, os.path.dirname(socket_path)))
            spec.env = network.proxy_env(spec.env, socket_path is not None)
            launch = await self.sandbox.wrap(request, spec.command, spec.cwd, network.SandboxNet(socket_path))
            spec.launch_argv, spec.launch_fds = launch.argv, list(launch.fds)
            spec.sandboxed = True
        else:
            log_event(
                "agent_unsandboxed",
                f"instance {spec.instance_id} of session {spec.session_id}: agent started WITHOUT a sandbox"
                " (agents.sandbox = \"off\"): it can reach everything this server's user can",
                priority=4,
                INSTANCE_ID=spec.instance_id,
                SESSION_ID=spec.session_id,
                TASK_ID=spec.task_id,
                AGENT=spec.agent,
            )
        agent_memory = self._memory_cgroup(spec, max_memory)
        kwargs: dict[str, Any] = {}
        if server.handshake_timeout is not None:
            kwargs["handshake_timeout"] = server.handshake_timeout
        inst = Instance(
            spec,
            agent_log_dir=Path(server.config.agent_log_dir),
            turn_ids=server.turn_ids,
            on_change=server.changed,
            detached_event_limit=server.detached_event_limit,  # per instance, by its own stream (AC-EXECUTORS-SURVIVAL-001.9)
            **kwargs,
        )
        inst.memory = agent_memory
        server.instances[spec.instance_id] = inst
        self.egress.log_to(spec.instance_id, lambda line: stderr_drain.note_line(inst.stderr_sink, line))
        server.changed()
        try:
            await inst.start()
        except BaseException as exc:
            await inst.stop()
            server.instances.pop(spec.instance_id, None)
            server.changed()
            if spec.sandboxed and isinstance(exc, IpcError) and "bwrap: " in inst.stderr_tail(1024):
                # bwrap's own error: a host that no longer admits the sandbox says so in its type
                support = await self.sandbox.probe()
                if not support.available:
                    raise sandbox.unavailable(support.reason or "unknown") from None
            raise
        if server.shutting_down:  # shut down while the agent was starting
            await inst.stop()
            server.instances.pop(spec.instance_id, None)
            raise IpcError(ErrorCode.SHUTTING_DOWN, "the control server is shutting down: the agent was not started")
        log_event(
            "instance_started",
            f"instance {spec.instance_id} started: agent {spec.agent or spec.command[0]} pid {inst.pid}"
            f" ({'sandboxed' if spec.sandboxed else 'NOT sandboxed'}; memory "
            + (f"bounded to {agent_memory.limit} bytes)" if agent_memory else f"UNBOUNDED: {self.sandbox.memory.reason})"),
            INSTANCE_ID=spec.instance_id,
            SESSION_ID=spec.session_id,
            TASK_ID=spec.task_id,
            PID=inst.pid,
            AGENT=spec.agent,
            SANDBOXED=int(spec.sandboxed),
            MAX_MEMORY=agent_memory.limit if agent_memory else None,
            MEMORY_CGROUP=agent_memory.path if agent_memory else None,
        )
        return inst

    def _memory_cgroup(self, spec: InstanceSpec, max_memory: int | None) -> AgentMemory | None:
        """The agent's memory cgroup with its bound, where this server can make one (None: it cannot,
        and ``sandbox_status`` says why). A failure to make it refuses the launch: an agent never runs
        unbounded on a host that bounds agents."""
        host = self.sandbox.memory
        if max_memory is None or not host.bounded:
            return None
        try:
            made = AgentMemory.create(host, spec.instance_id, max_memory)
        except (OSError, ValueError) as exc:
            close_launch_fds(spec)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise IpcError(ErrorCode.AGENT_ERROR, f"create_instance: cannot make the agent's memory cgroup below"
                           f" {host.base}: {why}", retryable=False) from None
        spec.max_memory, spec.memory_cgroup = max_memory, made.path
        return made

    async def _open_egress(self, spec: InstanceSpec, policy: NetworkPolicy) -> str | None:
        """The agent's egress proxy socket (None: mode ``"none"``), recorded in its spec."""
        try:
            path = await self.egress.open(spec.instance_id, spec.session_id, spec.agent, policy)
        except OSError as exc:
            raise sandbox.unavailable(f"cannot open the agent's egress proxy socket: {exc}") from None
        spec.network = self.egress.record(spec.instance_id, policy, path)
        return path

    async def _agent_secrets(self, agent: Any, refs: Any) -> dict[str, str]:
        """The values of the agent's ``secret_env`` references, read off the loop (agent_env)."""
        try:
            parsed = agent_env.parse_refs(refs, f"agents.{agent or '?'}.secret_env")
        except SettingsError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the agent's keys are refused: {exc}") from None
        if not parsed:
            return {}
        try:
            return await asyncio.to_thread(
                agent_env.resolve, parsed, f"agents.{agent or '?'}.secret_env",
                credentials_dir=os.environ.get("CREDENTIALS_DIRECTORY"), forbidden=self.sandbox.own_paths())
        except agent_env.SecretUnavailable as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the agent's key cannot be read: {exc}",
                           retryable=False) from None

    async def stop(self, instance_id: str) -> bool:
        """Stop and forget one instance; False if there is none (an absent instance counts as stopped)."""
        inst = self.server.instances.get(instance_id)
        if inst is None:
            return False
        await inst.stop()
        await self.egress.close(instance_id)
        self.server.instances.pop(instance_id, None)
        self.server.changed()
        return True

    async def stop_all(self) -> list[str]:
        """Stop every instance (in parallel; each stop is bounded); returns their ids.

        Stopping everything ends the server, so it happens once: a later call (a second
        ``ownership_shutdown``, the signal path after it) waits for the same stop and returns the
        same ids, whether it came while the instances were stopping or after."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_all())
        return list(await asyncio.shield(self._stopping))

    async def _stop_all(self) -> list[str]:
        instances = list(self.server.instances.values())
        results = await asyncio.gather(*(inst.stop() for inst in instances), return_exceptions=True)
        for inst, result in zip(instances, results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping instance %s failed: %r", inst.instance_id, result)
            self.server.instances.pop(inst.instance_id, None)
        await self.egress.close_all()
        self.server.changed()
        return [inst.instance_id for inst in instances]

    async def run_agent_log_bounds(self) -> None:
        """Keep the agents' stderr files bounded (``agent_logs``): old files of instances this
        server does not run are pruned at start and hourly; running instances' files are capped
        about every minute."""
        server = self.server
        directory = Path(server.config.agent_log_dir)
        last_prune: float | None = None
        while not server.shutting_down:
            if last_prune is None or time.monotonic() - last_prune >= agent_logs.PRUNE_EVERY_S:
                last_prune = time.monotonic()
                keep = {inst.stderr_path for inst in server.instances.values()}
                async with server.background_io:
                    removed = await asyncio.to_thread(agent_logs.prune, directory, keep)
                if removed:
                    log_event("agent_logs_pruned", f"removed {len(removed)} agent stderr file(s) of instances"
                              f" not running here and not written for {agent_logs.MAX_AGE_S // 86400} days",
                              COUNT=len(removed))
            for inst in list(server.instances.values()):
                if inst.stderr_sink is not None:
                    continue  # bounded while written (stderr_drain.StderrSink)
                async with server.background_io:
                    dropped = await asyncio.to_thread(agent_logs.cap, inst.stderr_path)
                if dropped:
                    log_event("agent_log_truncated", f"instance {inst.instance_id}: cut {dropped} bytes of agent"
                              f" stderr (kept under {agent_logs.MAX_BYTES} bytes)", INSTANCE_ID=inst.instance_id,
                              DROPPED=dropped)
            await asyncio.sleep(agent_logs.CAP_EVERY_S)
