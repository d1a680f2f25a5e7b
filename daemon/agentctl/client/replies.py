"""The answers of the control-server ops the backend consumes, as ``TypedDict``s.

They describe the wire (msgpack maps) as ``AgentctlClient`` returns it, so a reader of the backend
sees which fields an answer carries; fields a server of an older protocol may leave out are
``NotRequired``. The server builds these answers in ``daemon.agentctl.server`` and
``Instance.describe``.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class ServerIdentity(TypedDict):
    """``identify`` (unauthenticated): who answers on the socket."""

    server_identity: str
    capabilities: list[str]
    protocol_version: NotRequired[list[int]]
    unowned_period_s: NotRequired[float]


class CreatedInstance(TypedDict):
    """``create_instance``: the agent runs and its ACP session exists."""

    instance_id: str
    pid: int | None
    pid_start_time: float | None
    pid_start_stamp: NotRequired[str | None]  # 0.3.0 and later: boot id and start ticks
    acp_session_id: str | None
    modes: NotRequired[Any]
    config_options: NotRequired[list[dict[str, Any]]]
    handshake_seq: NotRequired[int]  # the last event of the handshake (a session/load replay included)
    sandboxed: NotRequired[bool]


class InstanceEntry(TypedDict):
    """One entry of ``list_instances`` (``Instance.describe``); never the environment."""

    instance_id: str
    session_id: str
    task_id: str
    agent: NotRequired[str | None]
    pid: int | None
    pid_start_time: float | None
    pid_start_stamp: NotRequired[str | None]  # 0.3.0 and later: boot id and start ticks
    acp_session_id: str | None
    state: str
    exit_code: NotRequired[int | None]
    cwd: NotRequired[str]
    workspace_roots: NotRequired[list[str]]
    current_turn_id: NotRequired[str | None]
    next_seq: NotRequired[int]
    retained_events: NotRequired[int]
    attached: NotRequired[bool]
    paused: NotRequired[bool]
    detached_event_limit: NotRequired[int]
    sandboxed: NotRequired[bool]
    modes: NotRequired[Any]
    config_options: NotRequired[list[dict[str, Any]]]
    not_taken_over: NotRequired[list[str]]


class NewProviderSession(TypedDict):
    """``reset_context``: a new ACP session on the same agent process."""

    acp_session_id: str
    modes: NotRequired[Any]
    config_options: NotRequired[list[dict[str, Any]]]
    last_seq: NotRequired[int]


class StopResult(TypedDict):
    """``stop_instance``: an instance already gone counts as stopped."""

    stopped: bool
    already_absent: bool


class TurnOutcome(TypedDict):
    turn_id: str
    stop_reason: str | None
    error: NotRequired[str | None]


class TurnStatus(TypedDict):
    """``turn_status`` (a pure read): the open turn and every retained outcome."""

    current_turn_id: str | None
    outcomes: list[TurnOutcome]


class ServerInfo(TypedDict):
    """``server_info`` (protocol 1.1, ``reload.v1``): the running version and its reload history."""

    version: str
    pid: int
    reload: dict[str, Any]


class ReloadStarted(TypedDict):
    """``reload``: the re-exec attempt started (or joined)."""

    attempt: int
    version: str
    pid: int
