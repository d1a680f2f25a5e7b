"""The few private parts of the ACP SDK (0.12.1) that a re-exec hand-over touches.

A hand-over has to stop one ``acp.Connection`` at a message boundary and give its
conversation to a fresh ``Connection`` in the next process image: the requests we
sent whose answers are still to come (``Connection._pending``, keyed by JSON-RPC
id), the next id (``_next_request_id``), the agent's requests still awaiting our
answer (replayed with ``_process_message``, which starts their handlers without
telling the observers again) and the receive loop (``_recv_task``). The agent's pipes
themselves are asyncio's business (``daemon.agentctl.instance.pipe_internals``).
No public API offers these; they are reached only here, and ``check()`` (run by
the preflight of every reload, with the code about to be executed) verifies that
they, and the asyncio parts, still exist, so an SDK or Python upgrade that moves them refuses
the reload instead of losing a conversation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import acp
from acp.connection import Connection

from daemon.agentctl.instance import pipe_internals

RECEIVE_TASK_NAME = "acp.Connection.receive"


def _connection(conn: acp.ClientSideConnection) -> Connection:
    inner: Connection = conn._conn
    return inner


def stop_receiving(conn: acp.ClientSideConnection) -> asyncio.Task[Any] | None:
    """Cancel the receive loop (it returns quietly on cancellation, without disconnecting)."""
    task = _connection(conn)._recv_task
    if task is not None and not task.done():
        task.cancel()
    return task


def restart_receiving(conn: acp.ClientSideConnection) -> None:
    """A new receive loop after ``stop_receiving`` (a refused reload goes on serving)."""
    c = _connection(conn)
    c._recv_task = c._tasks.create(c._receive_loop(), name=RECEIVE_TASK_NAME, on_error=c._on_receive_error)


def receiving(conn: acp.ClientSideConnection) -> bool:
    task = _connection(conn)._recv_task
    return task is not None and not task.done()


def pending_request_ids(conn: acp.ClientSideConnection) -> list[Any]:
    """JSON-RPC ids of our requests whose answer has not arrived."""
    return [rid for rid, fut in _connection(conn)._pending.items() if not fut.done()]


def next_request_id(conn: acp.ClientSideConnection) -> int:
    return int(_connection(conn)._next_request_id)


def restore_requests(conn: acp.ClientSideConnection, next_id: int, ids: list[int]) -> dict[int, asyncio.Future[Any]]:
    """Make ``conn`` wait for the answers to ``ids`` (sent by the previous image) and continue
    numbering at ``next_id``; returns the futures the answers will resolve."""
    c = _connection(conn)
    c._next_request_id = max(int(next_id), max(ids, default=-1) + 1)
    loop = asyncio.get_running_loop()
    futures: dict[int, asyncio.Future[Any]] = {}
    for rid in ids:
        futures[rid] = c._pending[rid] = loop.create_future()
    return futures


def replay_request(conn: acp.ClientSideConnection, message: dict[str, Any]) -> None:
    """Handle an agent's request again (its handler answers it later), without the observers."""
    _connection(conn)._process_message(message)


class _NoTransport:
    async def send(self, message: dict[str, Any]) -> None:  # pragma: no cover - never called
        raise ConnectionError("no transport")

    async def receive(self) -> dict[str, Any] | None:  # pragma: no cover - never called
        return None

    async def close(self) -> None:  # pragma: no cover - never called
        return None


def check() -> None:
    """Raise RuntimeError naming what is missing if this SDK or asyncio lacks a part used above."""
    missing: list[str] = []
    for name in ("_receive_loop", "_process_message", "_on_receive_error", "_handle_response"):
        if not callable(getattr(Connection, name, None)):
            missing.append(f"acp.connection.Connection.{name}")

    async def _noop(*_args: Any) -> None:
        return None

    c = Connection(_noop, _NoTransport(), listening=False)
    for name in ("_pending", "_next_request_id", "_recv_task", "_tasks"):
        if not hasattr(c, name):
            missing.append(f"acp.connection.Connection().{name}")
    if not isinstance(getattr(c, "_pending", None), dict):
        missing.append("acp.connection.Connection()._pending as a dict")
    if not callable(getattr(getattr(c, "_tasks", None), "create", None)):
        missing.append("acp.task.TaskSupervisor.create")
    missing += pipe_internals.missing()
    if missing:
        raise RuntimeError("the ACP SDK or asyncio lacks what a hand-over needs: " + ", ".join(missing))
