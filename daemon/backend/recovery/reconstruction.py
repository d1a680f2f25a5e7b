"""What a re-tracked execution is rebuilt from: the recovery-inventory ``Record`` read before any
contact, and the declared source of every value it gets back (AC-EXECUTORS-SURVIVAL-002.14).

``reconstruct`` collects each value from its one declared source and raises ``MissingInput`` when
a required one is authoritatively absent (AC-EXECUTORS-SURVIVAL-002.4); ``Recovery`` then declines
the record (``daemon.backend.recovery.recovery``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Record:
    """A live standalone recovery-inventory row, as read before any contact."""

    session_id: str
    task_id: str
    instance_id: str
    last_event_seq: int
    passthrough: bool
    agent_profile: str | None
    workspace_path: str | None


class MissingInput(Exception):
    """A required reconstruction value is authoritatively absent (AC-EXECUTORS-SURVIVAL-002.4)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


# Declared source of every value a re-tracked execution gets back (AC-EXECUTORS-SURVIVAL-002.14):
#   (a) the recovery-inventory row   (b) another durable record of ours
#   (c) the adopted instance          (d) re-derived from (a)-(c), never read from the instance
RECONSTRUCTION_SOURCES: dict[str, str] = {
    "session_id": "a",  # row.session_id (also the correlation key the server reports, AC-EXECUTORS-SURVIVAL-002.1)
    "task_id": "a",
    "workspace_path": "a",
    "instance_id": "a",  # row.instance_id, the agent execution id (duplicate tie-break, AC-EXECUTORS-SURVIVAL-002.10)
    "agent_profile": "a",  # row.agent_profile
    "last_event_seq": "a",
    "passthrough": "b",  # task_sessions.passthrough, the durable mode (AC-EXECUTORS-SURVIVAL-005.3)
    "acp_session_id": "c",  # the provider session id the instance holds
    "workspace_roots": "c",  # read back from the instance, never pushed to it (AC-EXECUTORS-SURVIVAL-002.5)
    "agent_pid": "c",
    "agent_pid_start_time": "c",
    "agent_pid_start_stamp": "c",
    "agent_command": "d",  # re-derived from agent_profile and the built-in registry as it is now (AC-EXECUTORS-SURVIVAL-002.3)
}


def reconstruct(rec: Record, instance: dict[str, Any], commands: dict[str, list[str] | None] | None = None
                 ) -> dict[str, Any]:
    """Collect every value from its one declared source; a required one missing → MissingInput.
    ``commands``: the agent commands already re-derived in this recovery, by profile (derived
    once per profile and run: the registry does not change during one recovery)."""
    from daemon.agents.registry import get_agent

    values: dict[str, Any] = {
        "session_id": rec.session_id,
        "task_id": rec.task_id,
        "workspace_path": rec.workspace_path,
        "instance_id": instance.get("instance_id"),
        "agent_profile": rec.agent_profile,
        "last_event_seq": rec.last_event_seq,
        "passthrough": rec.passthrough,
        "acp_session_id": instance.get("acp_session_id"),
        "workspace_roots": instance.get("workspace_roots"),
        "agent_pid": instance.get("pid"),
        "agent_pid_start_time": instance.get("pid_start_time"),
        "agent_pid_start_stamp": instance.get("pid_start_stamp"),
    }
    for name in ("workspace_path", "agent_profile", "acp_session_id", "workspace_roots", "agent_pid"):
        if not values[name]:
            raise MissingInput(name)
    profile = str(rec.agent_profile)
    if commands is None or profile not in commands:
        try:
            command: list[str] | None = list(get_agent(profile).argv())
        except KeyError:
            command = None
        if commands is not None:
            commands[profile] = command
    else:
        command = commands[profile]
    if command is None:
        raise MissingInput("agent_command")
    values["agent_command"] = list(command)
    return values
