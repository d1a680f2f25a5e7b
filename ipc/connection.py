"""The server side of one accepted connection, as handlers see it.

A ``ConnectionContext`` carries the peer's credentials, a per-connection
scratch ``state`` dict (e.g. ``{"authenticated": True}``), a ``closed``
event, and the write path. Frames are written whole (so they never
interleave) and nobody writes while the transport is above its high-water
mark: writers then queue on one lock, held only for write + drain, so a peer
that does not read applies backpressure to whoever writes to it (a stream
handler's ``send_event`` blocks) and server memory stays bounded.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from . import codec_msgpack
from .framing import ConnectionClosed
from .peercred import PeerCredentials

if TYPE_CHECKING:
    from .framing import Codec

_NO_STREAM: Any = object()
EVENTS_PER_WRITE = 256 * 1024
"""Bytes of event frames ``send_events`` joins into one write (then it waits for the peer as usual)."""


class ConnectionContext:
    """Per-connection state handed to every handler and to ``authorize``.

    Handlers use ``peer``, ``state``, ``closed``, ``streaming``, ``close``, ``start_stream`` and
    ``send_event``. The rest (``send_frame``, ``send_soon``, the flow-control callbacks and the
    ``closing`` / ``write_paused`` / ``stream_*`` / ``discarding`` flags) is the interface of the
    server that owns the connection (``ipc.server``, ``ipc.server_protocol``), not of handlers.
    """

    def __init__(self, peer: PeerCredentials, transport: asyncio.WriteTransport) -> None:
        self.peer = peer
        self.state: dict[str, Any] = {}
        self.closed = asyncio.Event()
        self._transport = transport
        self._write_lock = asyncio.Lock()
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.closing = False
        self.stream_id: Any = _NO_STREAM  # request id of this connection's stream op
        self.stream_task: asyncio.Task[None] | None = None
        self._streaming = False
        self._background: set[asyncio.Task[None]] = set()
        self.discarding = False  # lingering: our side is shut for writing, their input is dropped
        self.codec: Codec = codec_msgpack
        """The codec of this connection's frames, both ways: msgpack, or JSON once the peer's first
        frame was JSON on a server that accepts it (``ipc.server_protocol``)."""

    def __repr__(self) -> str:
        p = self.peer
        return f"<ConnectionContext pid={p.pid} uid={p.uid} gid={p.gid} closed={self.closed.is_set()}>"

    @property
    def streaming(self) -> bool:
        """True once ``start_stream`` has sent the ok response."""
        return self._streaming

    # -- closing -----------------------------------------------------------

    def close(self) -> None:
        """Close the connection from the server side (e.g. a credential was
        rotated). Idempotent. Frames already written are flushed first;
        ``closed`` is set at once."""
        if self.closing:
            return
        self.closing = True
        self.closed.set()
        self._transport.close()
        self._wake_writers("connection closed")

    def linger(self) -> None:
        """Close the way a refused peer is closed: shut our side for writing (the peer reads what
        was written, then EOF), drop whatever it still sends, and let the peer close; ``closed`` is
        set at once. Used by a hand-over, so a client sending meanwhile never gets a reset."""
        if self.closing:
            return
        self.closing = True
        self.discarding = True
        self.closed.set()
        self._wake_writers("connection closed")
        if self._transport.can_write_eof():
            self._transport.write_eof()
        else:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now, discarding unsent frames."""
        self.closing = True
        self.closed.set()
        self._transport.abort()
        self._wake_writers("connection aborted")

    # -- stream ops --------------------------------------------------------

    async def start_stream(self, result: Any) -> None:
        """Send the ok response of this connection's stream request.

        Only valid inside the handler of an ``Op`` with ``stream=True``;
        afterwards the connection carries only event frames.
        """
        if self.stream_id is _NO_STREAM:
            raise RuntimeError("start_stream() is only valid in the handler of a stream op")
        if self._streaming:
            raise RuntimeError("start_stream() called twice")
        await self.send_frame(self.codec.encode_frame({"id": self.stream_id, "ok": True, "result": result}))
        self._streaming = True

    async def send_event(self, seq: int, kind: str, data: Any) -> None:
        """Send one ``{seq, kind, data}`` frame, waiting while the peer is slow.

        Raises ``ConnectionClosed`` if the peer went away.
        """
        if not self._streaming:
            raise RuntimeError("send_event() before start_stream()")
        await self.send_frame(self.codec.encode_frame({"seq": seq, "kind": kind, "data": data}))

    async def send_events(self, events: list[tuple[int, str, Any]]) -> None:
        """``send_event`` for several events, in order, written together up to ``EVENTS_PER_WRITE``
        bytes at a time: a fast producer's events cost the peer one wake-up, not one each."""
        encode_frame = self.codec.encode_frame
        await self.send_event_frames([encode_frame({"seq": seq, "kind": kind, "data": data})
                                      for seq, kind, data in events])

    async def send_event_frames(self, frames: list[bytes]) -> None:
        """Event frames already encoded in this connection's codec (``codec_msgpack.event_frame``
        for a msgpack connection), in order, written together up to ``EVENTS_PER_WRITE`` bytes at
        a time."""
        if not self._streaming:
            raise RuntimeError("events sent before start_stream()")
        pending: list[bytes] = []
        size = 0
        for frame in frames:
            pending.append(frame)
            size += len(frame)
            if size >= EVENTS_PER_WRITE:
                await self.send_frame(b"".join(pending))
                pending, size = [], 0
        if pending:
            await self.send_frame(b"".join(pending) if len(pending) > 1 else pending[0])

    # -- the write path ----------------------------------------------------

    async def send_frame(self, data: bytes) -> None:
        """Write one encoded frame; return once the transport is below its high-water mark."""
        if self.closing or self._transport.is_closing():
            raise ConnectionClosed("connection closed")
        if self.try_send(data):  # fast path: nobody is waiting on the peer
            if self.write_paused:
                await self.settle()
            return
        async with self._write_lock:
            await self._drain()
            self._transport.write(data)
            await self._drain()

    def try_send(self, data: bytes) -> bool:
        """Write ``data`` at once if no writer waits on the peer (the common case) and say so; on
        False the caller awaits ``send_frame(data)``, and after a True that left ``write_paused``
        set it awaits ``settle()``. A request's response costs no coroutine this way."""
        if self.closing or self.write_paused or self._write_lock.locked() or self._transport.is_closing():
            return False
        self._transport.write(data)
        return True

    async def settle(self) -> None:
        """After a write that filled the pipe: wait for the drain, holding the write lock, so that
        later writers queue behind it."""
        async with self._write_lock:
            await self._drain()

    def send_soon(self, data: bytes) -> None:
        """``send_frame`` from synchronous code (protocol callbacks); errors are dropped."""
        if self.closing:
            return
        if not self.write_paused and not self._write_lock.locked():
            self._transport.write(data)
            return
        task = asyncio.get_running_loop().create_task(self._send_quietly(data))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_quietly(self, data: bytes) -> None:
        try:
            await self.send_frame(data)
        except ConnectionClosed:
            pass

    async def _drain(self) -> None:
        while self.write_paused:
            if self.closing:
                raise ConnectionClosed("connection closed")
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
        if self.closing:
            raise ConnectionClosed("connection closed")

    def _wake_writers(self, closed_reason: str | None) -> None:
        """Wake writers waiting for drain: to go on, or (with a reason) to fail."""
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                if closed_reason is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(ConnectionClosed(closed_reason))

    # -- called by the protocol ----------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writers(None)

    def connection_lost(self) -> None:
        self.closing = True
        self.closed.set()
        self._wake_writers("connection lost")
