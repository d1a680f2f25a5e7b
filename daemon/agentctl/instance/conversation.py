"""The conversation with one agent over ACP: the handshake, bounded requests, the turns and the
agent's permission requests.

- ``Handshake``: ``initialize``, then ``session/new`` or ``session/load`` (its history replay
  settled by the instance); ``failure_reason`` says in words why one failed; ``request`` is one
  ACP request on the current session, bounded in time, its refusals typed; ``session_info`` is
  the JSON of what the agent reported about a session (modes, config options).
- ``TurnIds``: server-wide turn ids ``<server_identity>:<n>``.
- ``Turns``: the open turn and the outcomes retained until ``ack_turn`` names them; a turn's
  outcome is retained exactly once, after every ``session_update`` the agent sent before its
  answer (AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.6).
- ``Permissions``: the agent's ``session/request_permission`` requests, each an event with a
  request id of ours, answered by ``respond_permission``, a ``cancel``, the agent's exit or
  ``stop()``. There is no auto-cancel timer, attached or not: a request raised while detached
  never expires (AC-EXECUTORS-SURVIVAL-001.9; docs/architecture.md#the-control-server-inside).

When to speak, and the instance state it changes, is ``daemon.agentctl.instance.instance``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import acp
from acp.exceptions import RequestError
from acp.schema import ClientCapabilities, Implementation

from daemon.agentctl.handover import PermissionHandover
from daemon.agentctl.instance import tool_processes
from daemon.agentctl.instance.events import EventLog, plain
from daemon.agentctl.protocol import EventKind
from daemon.core.version import VERSION
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

CLIENT_NAME = "kandev-agentctl"
CLIENT_VERSION = VERSION


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
        self.started_ticks: int | None = None  # the open turn's start (tool_processes.boot_ticks)
        self.cancelled: str | None = None  # the turn a cancel was sent for (its leftover tools are ended)

    def open(self, turn_id: str, text: str) -> None:
        self.current = turn_id
        self.started_ticks = tool_processes.boot_ticks()
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


MAX_OPEN_PERMISSIONS = 64
"""Open permission requests one agent may have; past it a request is answered ``cancelled`` at
once (with an ``agent_error`` saying why). An agent asks one at a time and waits; without a bound,
one that asks without waiting would grow the server for every agent."""
_REFUSED = ""  # in a tool call's queue, where a refused request's answer is ("" is no request id)


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
        tool_call_id = str(tool_call.get("toolCallId"))
        if len(self.requests) >= MAX_OPEN_PERMISSIONS:
            # Queued as refused, so that the answers of the requests around it keep their order.
            self._fifo.setdefault(tool_call_id, deque()).append(_REFUSED)
            self.log.append(EventKind.AGENT_ERROR, {"message": (
                f"permission request cancelled unasked: the agent already has {MAX_OPEN_PERMISSIONS} open")})
            return
        request_id = os.urandom(16).hex()
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
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


# ---------------------------------------------------------------- the ACP requests


class HandshakeRefused(Exception):
    """The agent answered the handshake with something we cannot use."""


class Handshake:
    """Where a handshake got to (``step``, for the failure's words) and what it learnt."""

    def __init__(self) -> None:
        self.step = "initialize"
        self.acp_session_id: str | None = None
        self.session_info: dict[str, Any] = {"modes": None, "config_options": []}

    async def run(self, conn: acp.ClientSideConnection, cwd: str, resume_session_id: str | None, timeout: float,
                  settle: Callable[[], Awaitable[None]]) -> None:
        """``initialize``, then ``session/load`` of ``resume_session_id`` (and ``settle`` while
        the agent replays its history) or ``session/new``."""
        self.step = "initialize"
        init = await within(
            conn.initialize(
                protocol_version=acp.PROTOCOL_VERSION,
                client_capabilities=ClientCapabilities(),
                client_info=Implementation(name=CLIENT_NAME, version=CLIENT_VERSION),
            ),
            timeout,
        )
        if init.protocol_version != acp.PROTOCOL_VERSION:
            raise HandshakeRefused(
                f"the agent speaks ACP protocol version {init.protocol_version}, not {acp.PROTOCOL_VERSION}"
            )
        if resume_session_id:
            self.step = "session/load"
            loaded = await within(conn.load_session(cwd=cwd, session_id=resume_session_id), timeout)
            # The answer names no session (ACP's LoadSessionResponse has no sessionId): the
            # loaded session is the one asked for.
            self.acp_session_id = resume_session_id
            self.session_info = session_info(loaded)
            self.step = "session/load (its history replay)"
            await settle()
        else:
            self.step = "session/new"
            session = await within(conn.new_session(cwd=cwd), timeout)
            self.acp_session_id = session.session_id
            self.session_info = session_info(session)


def failure_reason(step: str, exc: BaseException | None, timeout: float) -> str:
    """Why a handshake failed at ``step``, in words."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"no answer to {step} within {timeout:g} s"
    if isinstance(exc, RequestError):
        return f"the agent refused {step}: {rpc_error_text(exc)}"
    if exc is None or isinstance(exc, ConnectionError | OSError):
        return f"the agent went away during {step}"
    return f"{step} failed: {exc}"


async def request(conn: acp.ClientSideConnection, what: str,
                  call: Callable[[acp.ClientSideConnection], Awaitable[Any]], timeout: float) -> Any:
    """One ACP request on the current session; a refusal is ``agent_error`` (not retryable)."""
    try:
        return await within(call(conn), timeout)
    except RequestError as exc:
        raise IpcError(ErrorCode.AGENT_ERROR, f"the agent refused {what}: {rpc_error_text(exc)}", False) from None
    except TimeoutError:
        raise IpcError(ErrorCode.TIMEOUT, f"no answer to {what} within {timeout:g} s") from None
    except (ConnectionError, OSError) as exc:
        raise IpcError(ErrorCode.AGENT_ERROR, f"cannot reach the agent for {what}: {exc}", False) from None


def _dump(model: Any) -> Any:
    """An SDK model the agent filled in, as msgpack-safe JSON (``events.plain``: an integer past
    64 bits becomes a string): it is answered in ``create_instance`` and ``list_instances``, where
    one unencodable value would fail the answer for every instance."""
    if model is None:
        return None
    if hasattr(model, "model_dump"):
        return plain(model.model_dump(mode="json", by_alias=True, exclude_none=True))
    return plain(model)


def dump_list(items: Any) -> list[Any]:
    return [_dump(i) for i in items or []]


def session_info(response: Any) -> dict[str, Any]:
    """The modes and config options an ACP session/new|load answer reported, as JSON."""
    return {
        "modes": _dump(getattr(response, "modes", None)),
        "config_options": dump_list(getattr(response, "config_options", None)),
    }
