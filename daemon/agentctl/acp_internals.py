"""The few private parts of the ACP SDK (0.12.1) and of asyncio that a re-exec hand-over touches.

A hand-over has to stop one ``acp.Connection`` at a message boundary and give its
conversation to a fresh ``Connection`` in the next process image: the requests we
sent whose answers are still to come (``Connection._pending``, keyed by JSON-RPC
id), the next id (``_next_request_id``), the agent's requests still awaiting our
answer (replayed with ``_process_message``, which starts their handlers without
telling the observers again), the receive loop (``_recv_task``), and the bytes an
``asyncio.StreamReader`` read from the pipe but nobody consumed (``_buffer``; the agent's
complete lines are also taken from it in one go, ``take_lines``, which costs a fraction of a
``readuntil`` call per line).
No public API offers these; they are reached only here, and ``check()`` (run by
the preflight of every reload, with the code about to be executed) verifies that
they still exist, so an SDK upgrade that moves them refuses the reload instead of
losing a conversation.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import acp
from acp.connection import Connection

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


def buffered_bytes(reader: asyncio.StreamReader | None) -> bytes:
    """What ``reader`` holds: read from the pipe, not yet consumed."""
    return b"" if reader is None else bytes(reader._buffer)  # type: ignore[attr-defined]


def take_lines(reader: asyncio.StreamReader) -> list[bytes]:
    """Every complete line ``reader`` holds, taken out of its buffer at once, each with its
    newline: what ``readuntil`` would return, one coroutine call each. The reader resumes
    reading the pipe if its buffer was full."""
    buffer: bytearray = reader._buffer  # type: ignore[attr-defined]
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = [line + b"\n" for line in bytes(buffer[:end]).split(b"\n")]
    del buffer[:end + 1]
    reader._maybe_resume_transport()  # type: ignore[attr-defined]
    return lines


def _pipe_fd(transport: Any) -> int | None:
    pipe = transport.get_extra_info("pipe") if transport is not None else None
    if pipe is None or getattr(pipe, "closed", False):
        return None  # the pipe was closed (the agent closed its end and we saw it)
    return int(pipe.fileno())


def pause_pipe(reader: asyncio.StreamReader | None) -> bool:
    """Stop the pipe transport under ``reader`` from reading more into the reader's buffer (what
    the agent writes meanwhile stays in the pipe); True if it was reading and is paused now."""
    transport = None if reader is None else reader._transport  # type: ignore[attr-defined]
    # asyncio's pipe transport has no is_reading(); _paused is also set when the reader itself
    # paused it (its buffer is full), and then it is left to the reader
    if transport is None or transport.is_closing() or getattr(transport, "_paused", True):
        return False
    transport.pause_reading()
    return True


def resume_pipe(reader: asyncio.StreamReader | None) -> None:
    """Undo ``pause_pipe`` (only call it when that returned True)."""
    transport = None if reader is None else reader._transport  # type: ignore[attr-defined]
    if transport is not None and not transport.is_closing():
        transport.resume_reading()


def reader_fd(reader: asyncio.StreamReader | None) -> int | None:
    """The fd of the pipe ``reader`` reads (a subprocess's stdout); None once it is closed."""
    return None if reader is None else _pipe_fd(reader._transport)  # type: ignore[attr-defined]


def writer_fd(writer: asyncio.StreamWriter | None) -> int | None:
    """The fd of the pipe ``writer`` writes (a subprocess's stdin); None once it is closed."""
    return None if writer is None else _pipe_fd(writer.transport)


async def adopt_pipes(
    stdout_fd: int | None, stdin_fd: int | None, unread: bytes, limit: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over an agent's pipes inherited across an exec; ``unread`` comes out of the reader
    first, before anything the pipe holds. A pipe the previous image had seen closed (None) is
    closed here too: the reader ends after ``unread``, writes fail as to a gone agent."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    if unread:
        reader.feed_data(unread)
    if stdout_fd is None:
        reader.feed_eof()
    else:
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(stdout_fd, "rb", buffering=0)
        )
    if stdin_fd is None:
        read_end, stdin_fd = os.pipe()
        os.close(read_end)  # nobody reads: a write fails like a write to an agent that is gone
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(stdin_fd, "wb", buffering=0)
    )
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)


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
    if not isinstance(getattr(asyncio.StreamReader(), "_buffer", None), bytearray):
        missing.append("asyncio.StreamReader()._buffer")
    if not hasattr(asyncio.StreamReader(), "_transport"):
        missing.append("asyncio.StreamReader()._transport")
    if not callable(getattr(asyncio.StreamReader(), "_maybe_resume_transport", None)):
        missing.append("asyncio.StreamReader()._maybe_resume_transport")
    if not isinstance(getattr(asyncio.streams, "FlowControlMixin", None), type):
        missing.append("asyncio.streams.FlowControlMixin")
    if missing:
        raise RuntimeError("the ACP SDK or asyncio lacks what a hand-over needs: " + ", ".join(missing))
