"""Which process an agent is, as the backend records it: one value instead of three loose ones.

An agent is named by its pid, and told apart from a later process with the same pid by its start:
- ``start_stamp`` (``daemon.host.process_start.stamp``: the kernel's boot id and the start in ticks
  since boot) is what identity checks compare: no step of the wall clock moves it, and no other
  process has it, in this boot or a later one. Control servers before 0.3.0 send none, and rows
  written before it have none;
- ``start_time`` (wall-clock seconds, as the control server read it at spawn) is for people to
  read, and is compared only where no stamp was recorded.

The control server reports the three in its ``create_instance`` and ``list_instances`` replies;
the recovery inventory (``executors_running``) keeps them in three columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AgentIdentity:
    """An agent's pid and its start (see the module's docstring)."""

    pid: int | None
    start_time: float | None = None
    start_stamp: str | None = None

    @classmethod
    def reported(cls, instance: Mapping[str, Any]) -> AgentIdentity:
        """From a control server's description of an instance (``pid``, ``pid_start_time``,
        ``pid_start_stamp``)."""
        return cls(instance.get("pid"), instance.get("pid_start_time"), instance.get("pid_start_stamp"))

    @classmethod
    def recorded(cls, row: Any) -> AgentIdentity:
        """From an inventory row (``ExecutorRunning``)."""
        return cls(row.agent_pid, row.agent_pid_start_time, row.agent_pid_start_stamp)

    def record(self, row: Any) -> None:
        """Write it into an inventory row (``ExecutorRunning``)."""
        row.agent_pid = self.pid
        row.agent_pid_start_time = self.start_time
        row.agent_pid_start_stamp = self.start_stamp

    def shown(self) -> dict[str, Any]:
        """The fields ``session show`` gives it."""
        return {"agent_pid": self.pid, "agent_pid_start_time": self.start_time,
                "agent_pid_start_stamp": self.start_stamp}
