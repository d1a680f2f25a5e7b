"""The few private parts of asyncio's streams and pipe transports that an agent's pipes need.

Two users, one reason each:

- **Reading an agent in bursts** (``daemon.agentctl.instance.pipe``): the complete lines an
  ``asyncio.StreamReader`` holds are taken out of its buffer (``_buffer``) in one go
  (``take_lines``), which costs a fraction of a ``readuntil`` call per line; and the pipe
  transport under it is paused for a moment before a read that would wait (``pause_pipe``,
  ``resume_pipe``), so a streaming agent's lines gather in the pipe.
- **A re-exec hand-over** (``daemon.agentctl.reload.instance_handover``): the bytes a reader took from
  the pipe but nobody consumed (``buffered_bytes``), the pipes' fds (``reader_fd``,
  ``writer_fd``), and streams over the inherited fds in the next image (``adopt_pipes``).

No public API offers these; they are reached only here, and ``missing()`` (part of the reload
preflight's ``acp_internals.check``) says which of them a Python at hand lacks. This module
imports nothing but the standard library, so reading an agent's pipe does not bring in the ACP
SDK: through this path the backend once imported the SDK at every start (0.4 s), which
``tests/unit/test_cli_imports.py`` now guards against.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any


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


def missing() -> list[str]:
    """The parts used above that this Python's asyncio lacks (empty when all are there)."""
    gone: list[str] = []
    if not isinstance(getattr(asyncio.StreamReader(), "_buffer", None), bytearray):
        gone.append("asyncio.StreamReader()._buffer")
    if not hasattr(asyncio.StreamReader(), "_transport"):
        gone.append("asyncio.StreamReader()._transport")
    if not callable(getattr(asyncio.StreamReader(), "_maybe_resume_transport", None)):
        gone.append("asyncio.StreamReader()._maybe_resume_transport")
    if not isinstance(getattr(asyncio.streams, "FlowControlMixin", None), type):
        gone.append("asyncio.streams.FlowControlMixin")
    return gone
