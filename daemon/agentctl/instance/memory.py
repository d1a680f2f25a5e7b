"""One running agent's memory cgroup: joining it at spawn, the kernel's word that it ran out, the
read of a kill by the bound, and its removal once the agent is gone.

``AgentMemory`` wraps the agent's ``memory_cgroups.AgentCgroup`` for the instance that owns it. The
spawned child joins the cgroup itself before it executes the agent (``procs_fd`` goes to
``AgentProcess.spawn``), so nothing the agent starts is ever outside it. On cgroup v1 the kernel's
OOM killer ends one process; ``watch`` registers for the cgroup's OOM notification and, when it
comes, ends every process left in the cgroup (what ``memory.oom.group`` does on v2), so an agent
over its bound is ended whole on both hierarchies. ``killed_by_bound`` answers, once the agent
exited, whether the bound did it (the notification, or the cgroup's own OOM-kill counter).
``release`` removes the cgroup once its processes are gone; a re-exec carries the cgroup's path in
the instance's spec and the new image builds its ``AgentMemory`` again (``adopt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from daemon.agentctl.sandbox import memory_cgroups
from daemon.agentctl.sandbox.memory_cgroups import AgentCgroup, MemoryHost
from daemon.core.journal import log_event

log = logging.getLogger("kandev.agentctl.instance")

RELEASE_POLL_S = 0.05


class AgentMemory:
    """The memory cgroup of one agent (see the module docstring)."""

    def __init__(self, cgroup: AgentCgroup, instance_id: str) -> None:
        self.cgroup = cgroup
        self.instance_id = instance_id
        self.out_of_memory = False  # the kernel said the cgroup ran out (v1 notification)
        self._eventfd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def create(cls, host: MemoryHost, instance_id: str, limit: int) -> AgentMemory:
        """The cgroup of a new agent, made with its bound (OSError if the kernel refuses)."""
        return cls(memory_cgroups.create(host, instance_id, limit), instance_id)

    @classmethod
    def adopt(cls, host: MemoryHost, instance_id: str, path: str, limit: int) -> AgentMemory | None:
        """The cgroup a previous image of this server made for ``instance_id``: only the one this
        server's own record names (its cgroup and the instance id), and only if it still exists."""
        try:
            expected = memory_cgroups.agent_path(host, instance_id)
        except ValueError:
            return None
        if path != expected or not os.path.isdir(expected) or host.hierarchy is None:
            return None
        return cls(AgentCgroup(host.hierarchy, expected, limit), instance_id)

    @property
    def path(self) -> str:
        return self.cgroup.path

    @property
    def limit(self) -> int:
        return self.cgroup.limit

    def procs_fd(self) -> int:
        """A descriptor the spawned child writes its pid to (the caller closes it after the spawn)."""
        return memory_cgroups.open_procs(self.cgroup)

    def watch(self) -> None:
        """v1: be told when the cgroup runs out of memory (then end what is left of the agent)."""
        if self._eventfd is not None:
            return
        efd = memory_cgroups.oom_eventfd(self.cgroup)
        if efd is None:
            return
        self._eventfd, self._loop = efd, asyncio.get_running_loop()
        self._loop.add_reader(efd, self._on_oom)
        if memory_cgroups.oom_kills(self.cgroup) > 0:  # it ran out before we listened (spawn, re-exec)
            self._out_of_memory()

    def _on_oom(self) -> None:
        if self._eventfd is None:
            return
        with contextlib.suppress(OSError):
            os.eventfd_read(self._eventfd)
        self._out_of_memory()

    def _out_of_memory(self) -> None:
        if not self.out_of_memory:
            self.out_of_memory = True
            ended = memory_cgroups.kill_all(self.cgroup)
            log.warning("instance %s: its memory cgroup %s ran out of memory (bound %d bytes): ended %d process(es)",
                        self.instance_id, self.cgroup.path, self.cgroup.limit, ended)

    def killed_by_bound(self) -> bool:
        """Whether the memory bound ended the agent (call once it exited)."""
        return self.out_of_memory or memory_cgroups.oom_kills(self.cgroup) > 0

    def describe(self) -> dict[str, Any]:
        """What ``list_instances`` says of the agent's memory."""
        return {"max_memory": self.cgroup.limit, "memory_cgroup": self.cgroup.path}

    async def end(self, timeout: float, *, session_id: str | None = None) -> bool:
        """The agent is being stopped: SIGKILL whatever is still in the cgroup, then remove it."""
        memory_cgroups.kill_all(self.cgroup)
        return await self.release(timeout, session_id=session_id)

    def close(self) -> None:
        """Stop watching (the cgroup stays until ``release``)."""
        if self._eventfd is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._eventfd)
            with contextlib.suppress(OSError):
                os.close(self._eventfd)
            self._eventfd = None

    async def release(self, timeout: float, *, session_id: str | None = None, quiet: bool = False) -> bool:
        """Remove the cgroup once its processes are gone (up to ``timeout`` s); True when it is gone.
        Left behind, the journal says so (``memory_cgroup_left``) unless ``quiet`` (a later stop
        tries again)."""
        self.close()
        deadline = time.monotonic() + timeout
        while not memory_cgroups.remove(self.cgroup):
            if time.monotonic() >= deadline:
                if quiet:
                    return False
                log_event("memory_cgroup_left", f"instance {self.instance_id}: its memory cgroup {self.cgroup.path}"
                          f" still holds {len(memory_cgroups.members(self.cgroup))} process(es); not removed",
                          priority=4, INSTANCE_ID=self.instance_id, SESSION_ID=session_id, CGROUP=self.cgroup.path)
                return False
            await asyncio.sleep(RELEASE_POLL_S)
        return True
