"""The ACP requests an instance makes on its agent's connection, each bounded in time.

Owns the handshake (``initialize``, then ``session/new`` or ``session/load``: ``handshake``),
a bounded request on the current session with its refusals typed (``request``), the words a
failed handshake is reported in (``failure_reason``) and the JSON of what the agent reported
about a session (``session_info``). When to make them, and the state they change, is
``daemon.agentctl.instance``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import acp
from acp.exceptions import RequestError
from acp.schema import ClientCapabilities, Implementation

from daemon.agentctl.turns import rpc_error_text
from daemon.version import VERSION
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

CLIENT_NAME = "kandev-agentctl"
CLIENT_VERSION = VERSION


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
    if model is None:
        return None
    if hasattr(model, "model_dump"):
        return model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return model


def dump_list(items: Any) -> list[Any]:
    return [_dump(i) for i in items or []]


def session_info(response: Any) -> dict[str, Any]:
    """The modes and config options an ACP session/new|load answer reported, as JSON."""
    return {
        "modes": _dump(getattr(response, "modes", None)),
        "config_options": dump_list(getattr(response, "config_options", None)),
    }
