"""Whether agents can be sandboxed on this host, and the argv that runs one in its sandbox.

``SandboxHost`` owns the launch's ``SandboxSupport``: probed off the event loop at start, again
before a launch while it says no, and after a sandboxed agent died of bwrap's own error; a
re-exec hands it over (kept only until the new image's own probe replaces it). ``wrap`` turns an
agent's command into its sandboxed argv (``daemon.agentctl.sandbox.bubblewrap.wrap_command``), hiding what
of this server no agent may see. How a sandbox is built is ``daemon.agentctl.sandbox.bubblewrap``'s.
"""

from __future__ import annotations

import asyncio

from daemon.agentctl.sandbox import bubblewrap as sandbox
from daemon.agentctl.sandbox.bubblewrap import SandboxRequest, SandboxSupport
from daemon.agentctl.sandbox.network import SandboxNet
from daemon.agentctl.server_context import ServerContext
from daemon.core.journal import log_event
from daemon.host.agent_user import AgentUserMissing
from ipc.errors import ErrorCode, IpcError


class SandboxHost:
    """The sandbox support of one launch (see the module docstring)."""

    def __init__(self, server: ServerContext) -> None:
        self.server = server
        self.support: SandboxSupport | None = None
        self._lock = asyncio.Lock()

    async def probe(self) -> SandboxSupport:
        """Probe (off the event loop) whether an agent sandbox can be made here; log a change."""
        async with self._lock:
            async with self.server.background_io:  # the probe runs a trial bwrap from a worker thread
                support = await asyncio.to_thread(sandbox.probe)
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
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"create_instance: {exc}") from None
        except OSError as exc:
            raise sandbox.unavailable(f"cannot prepare the agent's user namespace: {exc}") from None
