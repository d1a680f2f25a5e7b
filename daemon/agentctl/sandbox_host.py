"""Whether agents can be sandboxed and their memory bounded on this host, and the argv that runs
one in its sandbox.

``SandboxHost`` owns the launch's ``SandboxSupport``: probed off the event loop at start, again
before a launch while it says no, and after a sandboxed agent died of bwrap's own error; a
re-exec hands it over (kept only until the new image's own probe replaces it). ``wrap`` turns an
agent's command into its sandboxed argv (``daemon.agentctl.sandbox.bubblewrap.wrap_command``), hiding what
of this server no agent may see. How a sandbox is built is ``daemon.agentctl.sandbox.bubblewrap``'s.

It also owns the launch's ``MemoryHost`` (``daemon.agentctl.sandbox.memory_cgroups``): where this
server makes its agents' memory cgroups, or why it cannot (then agents are unbounded and
``sandbox_status`` says why). It is probed once per process image, at start (a re-exec's new
image probes again: on cgroup v2 it finds itself in the leaf the first image moved it to), and
at a fresh start the empty cgroups of agents a previous lifetime left (``prune_memory``) go.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from daemon.agentctl.sandbox import bubblewrap as sandbox
from daemon.agentctl.sandbox import memory_cgroups
from daemon.agentctl.sandbox import probe as sandbox_probe
from daemon.agentctl.sandbox.bubblewrap import SandboxRequest, SandboxSupport
from daemon.agentctl.sandbox.memory_cgroups import MemoryHost
from daemon.agentctl.sandbox.network import SandboxNet
from daemon.agentctl.server_context import ServerContext
from daemon.core.journal import log_event
from daemon.host.agent_user import AgentUserMissing
from ipc.errors import ErrorCode, IpcError

PRUNE_AFTER_S = 60.0
"""How old an agent's empty memory cgroup must be before a fresh start removes it."""


class SandboxHost:
    """The sandbox support of one launch (see the module docstring)."""

    def __init__(self, server: ServerContext) -> None:
        self.server = server
        self.support: SandboxSupport | None = None
        self.memory: MemoryHost = MemoryHost(None, None, None, "not probed yet")
        self._lock = asyncio.Lock()

    def probe_memory(self) -> MemoryHost:
        """Where agents' memory cgroups go (see the module docstring); logged once."""
        host = self.memory = memory_cgroups.probe()
        log_event(
            "memory_probe",
            (f"agents' memory: bounded, each agent in a memory cgroup of its own below {host.base}"
             f" (cgroup {host.hierarchy})") if host.bounded else f"agents' memory: UNBOUNDED: {host.reason}",
            priority=6 if host.bounded else 4,
            BOUNDED=int(host.bounded),
            HIERARCHY=host.hierarchy,
            CGROUP=host.base,
            REASON=host.reason,
        )
        return host

    def prune_memory(self, older_than: float = PRUNE_AFTER_S) -> list[str]:
        """Remove the empty cgroups of agents below ours made more than ``older_than`` s ago: a
        previous lifetime's, left by a crash (a cgroup in use, or just made by a server sharing
        ours, is never removed: the kernel refuses a cgroup with processes, and a young one waits)."""
        removed = []
        for path in memory_cgroups.leftovers(self.memory):
            with contextlib.suppress(OSError):
                if time.time() - os.stat(path).st_mtime > older_than:
                    os.rmdir(path)
                    removed.append(path)
        return removed

    async def probe(self) -> SandboxSupport:
        """Probe (off the event loop) whether an agent sandbox can be made here; log a change."""
        async with self._lock:
            async with self.server.background_io:  # the probe runs a trial bwrap from a worker thread
                support = await asyncio.to_thread(sandbox_probe.probe)
            previous, self.support = self.support, support
            if previous is None or previous.available != support.available:
                log_event(
                    "sandbox_probe",
                    f"agent sandbox ({support.mechanism} {support.version or '?'}): "
                    + ("available" if support.available else f"unavailable: {support.reason}"),
                    priority=6 if support.available else 4,
                    AVAILABLE=int(support.available),
                    REASON=support.reason,
                    BWRAP=support.bwrap,
                )
            return support

    def own_paths(self) -> list[str]:
        """What of this server no agent may see, even where it lies inside something bound: the
        socket directory, the logs (agents' stderr included), the credential and its directory."""
        return self.server.config.own_paths()

    async def wrap(self, request: SandboxRequest, command: list[str], cwd: str,
                   net: SandboxNet | None = None) -> sandbox.Launch:
        """The agent's argv inside its sandbox (and the descriptors bwrap inherits), in its own
        network namespace (``net``); ``sandbox_unavailable`` when none can be made."""
        support = self.support
        if support is None or not support.available:
            support = await self.probe()  # the host may have been fixed meanwhile
        if not support.available or support.bwrap is None:
            raise sandbox.unavailable(support.reason or "unknown")
        sandbox.hidden_ok(request, cwd, self.own_paths())
        try:
            return await asyncio.to_thread(sandbox.wrap_command, request, command, cwd, bwrap=support.bwrap,
                                           extra_hidden=self.own_paths(), own_ipc=support.ipc_namespace, net=net)
        except AgentUserMissing as exc:
            raise sandbox.unavailable(str(exc)) from None
        except ValueError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the agent's sandbox cannot be made: {exc}") from None
        except OSError as exc:
            raise sandbox.unavailable(f"cannot prepare the agent's user namespace: {exc}") from None
