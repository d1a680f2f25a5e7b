"""``kandev doctor``'s ``agent_memory`` check: is each agent's memory bounded, and if not, why.

Agents' memory is bounded when the control server can give each agent a memory cgroup of its own
(``daemon.agentctl.sandbox.memory_cgroups``). The running control server's answer, which the
backend's ``status`` carries as ``memory``, decides; without one (no backend, no control server
yet) the check says where this host's memory controller is and what the control server needs
there. A failing check names the setting that is then not enforced and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.agents import memory
from daemon.config.platform import Check
from daemon.config.settings import Config

HINT = ("run the control server as kandev-agentctl.service (Delegate=yes) on cgroup v2, or as root where the"
        " memory controller is on cgroup v1; see docs/operations.md")


def host_controller() -> tuple[str | None, str]:
    """Where this host's memory controller is (``memory_cgroups.host_controller``)."""
    from daemon.agentctl.sandbox.memory_cgroups import host_controller as probe

    return probe()


def agent_memory(config: Config, reported: Any, controller: Callable[[], tuple[str | None, str]]) -> Check:
    """The check, from the control server's ``reported`` answer, else from ``controller()``."""
    bound = config.agents.max_memory if config.agents.max_memory is not None else memory.default_bound()
    setting = f"agents.max_memory = {memory.human_bytes(bound)}" + (
        " (half the host's RAM)" if config.agents.max_memory is None else "")
    if isinstance(reported, dict) and (reported.get("bounded") or reported.get("hierarchy")):
        if reported.get("bounded"):
            return Check("agent_memory", True, f"{setting}: each agent runs in a memory cgroup of its own (cgroup"
                         f" {reported.get('hierarchy')}, below {reported.get('cgroup')}), as the control server reports")
        return Check("agent_memory", False, f"agents' memory is UNBOUNDED ({setting} is not enforced):"
                     f" {reported.get('reason')}", HINT)
    hierarchy, detail = controller()
    if hierarchy is None:
        return Check("agent_memory", False, f"agents' memory is UNBOUNDED ({setting} is not enforced): {detail}", HINT)
    return Check("agent_memory", True, f"{setting}; {detail}")
