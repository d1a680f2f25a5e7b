"""The bytes of one proxied connection, copied from one socket to the other (``one_way``, ``both_ways``).

The proxy sits on the path of everything an agent downloads and streams, so its copy is the
kernel's: ``splice(2)`` moves what arrives on one socket into a pipe and from the pipe to the
other socket, and the bytes never enter this process (no read into a buffer of ours, no write
out of it, no Python object per chunk). Where the kernel refuses that for a socket (``EINVAL``:
no splice support), a ``recv_into``/``send`` loop over one buffer per direction does the same.

Both run on the event loop's readiness callbacks of the raw, non-blocking sockets (no transport,
no stream buffers in between). A long transfer lets the loop serve other connections at least
every ``YIELD_EVERY`` bytes. A direction ends at its source's end of stream by half-closing its
destination (``shutdown(SHUT_WR)``), so the other direction carries on (HTTP/1.1 over a tunnel,
a client that half-closes after its request); an error on either socket ends both directions.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket

PIPE_SIZE = 1024 * 1024
"""Bytes a direction's pipe grows to (``F_SETPIPE_SZ``; the system's maximum by default) once one
splice has filled half of its default 64 KiB: a bulk transfer then takes fewer system calls and
loop turns (measured in the proxy: ~40 against ~65 ms of CPU per 100 MiB). Only a direction that
carries bulk grows its pipe: every pipe of a user counts against ``fs.pipe-user-pages-soft`` (64 MiB
by default), past which each new pipe of that user (an unprivileged control server, and its agents
that share its uid) gets two pages only; a model's streamed answer never grows one. A pipe that
cannot be grown keeps its size: slower, as correct."""
BUFFER_SIZE = 256 * 1024  # the copy loop's buffer, where splice cannot be used
YIELD_EVERY = 4 * 1024 * 1024
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
_NO_SPLICE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    """Until ``fd`` is readable (writable with ``write``)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def _splice(loop: asyncio.AbstractEventLoop, src: int, dst: int) -> bool:
    """Copy ``src`` to ``dst`` through a pipe until ``src`` ends; False when splice cannot be used
    on these sockets (nothing was copied then)."""
    out, into = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        capacity = fcntl.fcntl(into, _F_GETPIPE_SZ)
        held = 0  # bytes in the pipe
        since_yield = 0
        ended = False
        first = True
        while True:
            if not ended:
                try:
                    moved = os.splice(src, into, PIPE_SIZE, flags=_SPLICE_FLAGS)
                except BlockingIOError:  # nothing to read (or the pipe is full: then drain it)
                    if not held:
                        await _ready(loop, src, False)
                        continue
                except OSError as exc:
                    if first and exc.errno in _NO_SPLICE:
                        return False
                    raise
                else:
                    first = False
                    ended = moved == 0
                    held += moved
                    since_yield += moved
                    if moved >= capacity // 2 and capacity < PIPE_SIZE:  # a bulk transfer: a larger pipe
                        try:
                            capacity = fcntl.fcntl(into, _F_SETPIPE_SZ, PIPE_SIZE)
                        except OSError:
                            capacity = PIPE_SIZE  # not to be had: never asked again
            if held:
                try:
                    held -= os.splice(out, dst, held, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    await _ready(loop, dst, True)
                    continue
                if since_yield >= YIELD_EVERY:
                    since_yield = 0
                    await asyncio.sleep(0)
            elif ended:
                return True
    finally:
        os.close(out)
        os.close(into)


async def _copy(loop: asyncio.AbstractEventLoop, src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends, through a buffer of ours."""
    view = memoryview(bytearray(BUFFER_SIZE))
    while True:
        n = await loop.sock_recv_into(src, view)
        if not n:
            return
        await loop.sock_sendall(dst, view[:n])


async def one_way(src: socket.socket, dst: socket.socket) -> None:
    """Everything ``src`` sends, to ``dst``; then ``dst`` is half-closed. OSError on a socket error."""
    loop = asyncio.get_running_loop()
    if not await _splice(loop, src.fileno(), dst.fileno()):
        await _copy(loop, src, dst)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


async def both_ways(a: socket.socket, b: socket.socket) -> None:
    """``a`` to ``b`` and ``b`` to ``a`` until both have ended; an error on either ends both (each
    socket is shut down, which ends the other direction's wait). Never raises OSError."""

    async def direction(src: socket.socket, dst: socket.socket) -> None:
        try:
            await one_way(src, dst)
        except OSError:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    await asyncio.gather(direction(a, b), direction(b, a))
