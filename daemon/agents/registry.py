"""Registry of the agents kandev knows how to start (``kandev agents``).

Each entry names its package and pinned version and builds the argv that
starts the agent speaking ACP over stdio.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinAgent:
    name: str
    package: str
    version: str
    argv_factory: Callable[[], list[str]]

    def argv(self) -> list[str]:
        """The command line that starts this agent."""
        return self.argv_factory()


def _mock_argv() -> list[str]:
    return [sys.executable, "-m", "daemon.agents.mock"]


BUILTIN_AGENTS: dict[str, BuiltinAgent] = {
    agent.name: agent
    for agent in (
        BuiltinAgent(name="mock", package="daemon.agents.mock", version="0.1.0", argv_factory=_mock_argv),
    )
}


def get_agent(name: str) -> BuiltinAgent:
    """The built-in agent called ``name``; KeyError naming the known agents otherwise."""
    try:
        return BUILTIN_AGENTS[name]
    except KeyError:
        known = ", ".join(sorted(BUILTIN_AGENTS))
        raise KeyError(f"unknown agent {name!r}; built-in agents: {known}") from None
