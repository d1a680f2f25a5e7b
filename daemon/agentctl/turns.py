"""One instance's turns and the agent's permission requests: the bookkeeping of a conversation.

- ``TurnIds``: server-wide turn ids ``<server_identity>:<n>``.
- ``Turns``: the open turn and the outcomes retained until ``ack_turn`` names them; a turn's
  outcome is retained exactly once, after every ``session_update`` the agent sent before its
  answer (AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.6).
- ``Permissions``: the agent's ``session/request_permission`` requests, each an event with a
  request id of ours, answered by ``respond_permission``, a ``cancel``, the agent's exit or
  ``stop()``. There is no auto-cancel timer, attached or not: a request raised while detached
  never expires (AC-EXECUTORS-SURVIVAL-001.9; docs/architecture.md#the-control-server-inside).

What is sent to the agent, and when, is ``daemon.agentctl.instance``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from acp.exceptions import RequestError

from daemon.agentctl.events import EventLog
from daemon.agentctl.handover import PermissionHandover
from daemon.agentctl.protocol import EventKind
from ipc.errors import ErrorCode, IpcError


def rpc_key(rpc_id: Any) -> str:
    """A JSON-RPC id as a dictionary key (ids may be numbers or strings)."""
    return json.dumps(rpc_id, sort_keys=True, default=str)


def rpc_error_text(exc: RequestError) -> str:
    text = str(exc) or "error"
    data = getattr(exc, "data", None)
    if data:
        with contextlib.suppress(TypeError, ValueError):
            text = f"{text} ({json.dumps(data)[:500]})"
    return text


class TurnIds:
    """Server-wide turn ids ``<server_identity>:<n>``: never repeated in a lifetime, nor across
    lifetimes, since the identity is random per launch (docs/architecture.md#the-control-server-inside)."""

    def __init__(self, server_identity: str, counter: int = 0) -> None:
        self._prefix = server_identity
        self._counter = counter  # a re-exec goes on from the previous image's counter

    @property
    def counter(self) -> int:
        return self._counter

    def __call__(self) -> str:
        self._counter += 1
        return f"{self._prefix}:{self._counter}"


class Turns:
    """The open turn of one instance and its retained outcomes."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.current: str | None = None
        self.outcomes: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def open(self, turn_id: str, text: str) -> None:
        self.current = turn_id
        self.log.append(EventKind.TURN_STARTED, {"turn_id": turn_id, "text": text})

    def end(self, turn_id: str, stop_reason: str, error: str | None, *, retain: bool) -> None:
        """Close the open turn (no-op if ``turn_id`` is not the open one); retain its outcome and
        append ``turn_ended`` unless the instance is going away (``retain`` false)."""
        if self.current != turn_id:
            return
        outcome = {"turn_id": turn_id, "stop_reason": stop_reason, "error": error}
        self.current = None
        if not retain:
            return
        self.outcomes[turn_id] = outcome
        self.log.append(EventKind.TURN_ENDED, dict(outcome))

    def status(self) -> dict[str, Any]:
        """Pure read (AC-EXECUTORS-SURVIVAL-004.6): the open turn and every retained outcome."""
        return {"current_turn_id": self.current, "outcomes": [dict(o) for o in self.outcomes.values()]}

    def ack(self, turn_id: str) -> bool:
        """Discard the retained outcome of ``turn_id``; False (and no change) if it is not held."""
        return self.outcomes.pop(turn_id, None) is not None


@dataclass
class Permission:
    request_id: str
    option_ids: list[str]
    future: asyncio.Future[str | None]
    rpc_id: str
    turn_id: str | None = None
    tool_call_id: str = ""
    message: dict[str, Any] = field(default_factory=dict)  # the agent's raw request (for a hand-over)


class Permissions:
    """The agent's open permission requests on one instance."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.requests: dict[str, Permission] = {}
        self._fifo: dict[str, deque[str]] = {}

    def add(self, permission: Permission) -> None:
        self.requests[permission.request_id] = permission
        self._fifo.setdefault(permission.tool_call_id, deque()).append(permission.request_id)

    def requested(self, rpc_id: Any, params: dict[str, Any], message: dict[str, Any], turn_id: str | None) -> None:
        """The agent's request arrived (the observer, in arrival order): number it as an event."""
        raw_tool_call, raw_options = params.get("toolCall"), params.get("options")
        tool_call: dict[str, Any] = raw_tool_call if isinstance(raw_tool_call, dict) else {}
        options: list[Any] = raw_options if isinstance(raw_options, list) else []
        option_ids = [str(o.get("optionId")) for o in options if isinstance(o, dict)]
        request_id = os.urandom(16).hex()
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        tool_call_id = str(tool_call.get("toolCallId"))
        self.add(Permission(request_id, option_ids, future, rpc_key(rpc_id), turn_id, tool_call_id, message))
        self.log.append(
            EventKind.PERMISSION_REQUEST,
            {"request_id": request_id, "turn_id": turn_id, "tool_call": tool_call, "options": options},
        )

    async def answer(self, tool_call_id: str) -> str | None:
        """Called by the SDK's request handler: wait for ``respond_permission`` (or stop/cancel)."""
        queue = self._fifo.get(tool_call_id)
        request_id = queue.popleft() if queue else None
        if queue is not None and not queue:
            del self._fifo[tool_call_id]
        pending = self.requests.get(request_id) if request_id else None
        if pending is None:
            return None
        return await pending.future

    def answered(self, rpc_id: Any) -> None:
        """Our JSON-RPC response went out: forget the request (also when the SDK refused it)."""
        if not self.requests:
            return
        key = rpc_key(rpc_id)
        for request_id, pending in list(self.requests.items()):
            if pending.rpc_id == key:
                del self.requests[request_id]
                if not pending.future.done():
                    pending.future.set_result(None)
                for tool_call_id, queue in list(self._fifo.items()):
                    if request_id in queue:
                        queue.remove(request_id)
                        if not queue:
                            del self._fifo[tool_call_id]

    def cancel_all(self, reason: str) -> None:
        """Answer every open request ``cancelled``; each one gets a ``permission_cancelled`` event
        (a no-op append once the log is closed, i.e. on stop)."""
        for pending in self.requests.values():
            if not pending.future.done():
                pending.future.set_result(None)
                self.log.append(
                    EventKind.PERMISSION_CANCELLED,
                    {"request_id": pending.request_id, "turn_id": pending.turn_id, "reason": reason},
                )

    def respond(self, request_id: str, option_id: str | None) -> None:
        pending = self.requests.get(request_id)
        if pending is None or pending.future.done():
            raise IpcError(ErrorCode.NOT_FOUND, f"no open permission request {request_id!r} on this instance")
        if option_id is not None and option_id not in pending.option_ids:
            raise IpcError(
                ErrorCode.INVALID_ARGUMENT,
                f"option {option_id!r} is not one of {pending.option_ids} offered by request {request_id}",
            )
        pending.future.set_result(option_id)

    def waiting(self) -> list[Permission]:
        """The requests nobody has answered yet (they travel in a hand-over)."""
        return [p for p in self.requests.values() if not p.future.done()]

    def handover(self) -> list[PermissionHandover]:
        return [PermissionHandover(p.request_id, list(p.option_ids), p.turn_id, p.tool_call_id, p.message)
                for p in self.waiting()]
