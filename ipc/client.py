"""The asyncio client: multiplexed calls and event streams over one socket.

``AsyncClient.call`` sends a request and awaits its response; any number of
calls may be in flight on one connection, matched to their responses by
request id. ``AsyncClient.stream`` turns a connection into an event stream:
after the stream op's ok response the connection belongs to the returned
``EventStream``.

The socket is read by ``_Link``, an ``asyncio.BufferedProtocol``: it decodes
frames as the bytes arrive and resolves each caller's future itself (no reader
task in between: a response reaches its caller one loop iteration sooner).
An event stream's frames wait in a bounded queue; while it holds
``STREAM_QUEUE_MAX`` frames or ``STREAM_QUEUE_BYTES`` bytes of them (as they
came over the wire) the link stops reading, so a slow consumer still applies
backpressure to the server. The bound in frames lets a consumer that stores
events in batches take a few hundred per wake-up (each batch has a fixed cost:
a transaction, an ack); the bound in bytes keeps large events from holding
much memory per stream.

The blocking client for the CLI lives in ``ipc.sync_client`` and is
re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from typing import Any, NamedTuple

from ipc.aio import within

from .codec_msgpack import decode_body, encode_frame
from .errors import ErrorCode, IpcError
from .framing import (
    MAX_FRAME,
    ConnectionClosed,
    FrameBuffer,
    InvalidFrame,
)
from .hello import HELLO, check_hello
from .sync_client import SyncClient

__all__ = ["AsyncClient", "Event", "EventStream", "SyncClient", "batch_events"]

log = logging.getLogger(__name__)

# A connection's receive buffer before a frame needs more (it grows to a frame's size and back): a
# backend keeps one connection per session it streams, so this is per session (1,000: 4 MiB).
_INITIAL_BUFFER = 4 * 1024
STREAM_QUEUE_MAX = 512  # event frames decoded ahead of the consumer before reading pauses...
STREAM_QUEUE_BYTES = 512 * 1024  # ...or this many of their bytes on the wire, whichever comes first


class Event(NamedTuple):
    """One ``{seq, kind, data}`` frame of an event stream. A named tuple: one is built per event
    streamed, in half the time of a frozen dataclass."""

    seq: int
    kind: str
    data: Any


def batch_events(items: Any) -> list[Event]:
    """The events of an event batch frame's ``events`` (``[[seq, kind, data], ...]``), in order;
    ``InvalidFrame`` for a malformed one."""
    if not isinstance(items, list):
        raise InvalidFrame("event batch frame without a list of events")
    events = []
    for item in items:
        if not isinstance(item, list) or len(item) != 3:
            raise InvalidFrame("event batch frame with a malformed event")
        seq, kind, data = item
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(kind, str):
            raise InvalidFrame("event batch frame with a malformed seq or kind")
        events.append(Event(seq, kind, data))
    return events


_END = object()  # in a stream's queue: the server closed the connection at a frame boundary


class _Link(asyncio.BufferedProtocol):
    """One client connection's socket: frames decoded as they arrive, write flow control.

    Before a stream takes the connection over, each frame goes to ``AsyncClient._route`` at once
    (it resolves the caller's future); after, frames queue for the ``EventStream``, ending with
    ``_END`` or the error that ended the stream.
    """

    def __init__(self) -> None:
        self.client: AsyncClient | None = None
        self.transport: asyncio.Transport | None = None
        self._frames = FrameBuffer(MAX_FRAME, _INITIAL_BUFFER, decode=decode_body)
        self.streaming = False
        self.queue: deque[Any] = deque()  # stream frames, then _END or an IpcError
        self._sizes: deque[int] = deque()  # each queued frame's bytes on the wire, in queue order
        self.queued_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._stopped = False  # the connection failed or ended: nothing more is decoded
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._frames.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self._frames.buffer_updated(nbytes)
        self.pump()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost says how it ended

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._stopped:
            self._stopped = True
            client = self.client
            path = client.path if client is not None else "?"
            ended: Any
            if self._frames.pending:
                ended = ConnectionClosed(f"connection to {path} lost: closed in the middle of a frame")
            elif exc is not None:
                ended = ConnectionClosed(f"connection to {path} lost: {exc}")
            elif self.streaming:
                ended = _END  # at a frame boundary: the stream is over
            else:
                ended = IpcError(ErrorCode.UNAVAILABLE, f"connection to {path} closed by the server")
            if self.streaming:
                self._end_stream(ended)
            elif client is not None:
                client._fail(ended)
        self._frames.close()
        self.write_paused = False
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_exception(ConnectionClosed("connection lost"))
        self._drain_waiters.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- reading -------------------------------------------------------------

    def pump(self) -> None:
        """Decode every complete frame buffered: to its caller, or to the stream's queue while it
        has room (reading stops when it has none and resumes as the consumer takes frames)."""
        client = self.client
        while not self._stopped and client is not None:
            if self.streaming and (len(self.queue) >= STREAM_QUEUE_MAX or self.queued_bytes >= STREAM_QUEUE_BYTES):
                self._pause_reading()
                return
            try:
                before = self._frames.pending
                frame = self._frames.next_frame()
                if frame is None:
                    break
                if self.streaming:
                    size = before - self._frames.pending
                    self.queue.append(frame)
                    self._sizes.append(size)
                    self.queued_bytes += size
                    self._wake()
                elif client._route(frame):
                    self.streaming = True
            except IpcError as exc:  # undecodable, too large, or a refusal: the connection is done
                self._stopped = True
                if self.streaming:
                    self._end_stream(exc)
                else:
                    client._fail(exc)
                if self.transport is not None:
                    self.transport.close()
                return
        self._resume_reading()

    async def next_stream_item(self) -> Any:
        """The stream's next frame, ``_END``, or the ``IpcError`` that ended it (left queued, so
        each later call sees the end again). Cancelling the wait loses nothing."""
        while not self.queue:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self.queue[0]
        return self._take() if isinstance(item, dict) else item

    def take_frames(self, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` stream frames already received, in order, without waiting (what is
        buffered and not yet decoded is decoded as the queue empties)."""
        queue = self.queue
        frames: list[dict[str, Any]] = []
        while len(frames) < limit and queue and isinstance(queue[0], dict):  # not the stream's end
            frames.append(self._take())
        return frames

    def _take(self) -> dict[str, Any]:
        """The first queued frame, removed; reading resumes once the queue has room again."""
        frame: dict[str, Any] = self.queue.popleft()
        self.queued_bytes -= self._sizes.popleft()
        if self._reading_paused:
            self.pump()  # decode what is buffered, then read again
        return frame

    def _end_stream(self, item: Any) -> None:
        self.queue.append(item)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
            self._reading_paused = True

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()
            self._reading_paused = False

    # -- writing -------------------------------------------------------------

    async def drain(self) -> None:
        """Return once the transport is below its high-water mark (``ConnectionClosed`` if lost)."""
        while self.write_paused:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(fut)
            await fut
        if self.lost.done():
            raise ConnectionClosed("connection lost")


class AsyncClient:
    """One connection to an ``IpcServer``. Create it with ``await AsyncClient.connect(path)``."""

    def __init__(self, path: str, link: _Link, protocol_major: int) -> None:
        self.path = path
        self.protocol_major = protocol_major
        self.server_hello: dict[str, Any] | None = None
        self._link = link
        assert link.transport is not None
        self._transport = link.transport
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 1
        self._write_lock = asyncio.Lock()
        self._failure: IpcError | None = None
        self.closed_by: IpcError | None = None  # the error that ended the connection, as it came
        self._stream_id: int | None = None
        link.client = self
        link.pump()  # anything that arrived before we were ready

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        protocol_major: int = 1,
        timeout: float = 5.0,
        hello: bool = True,
    ) -> AsyncClient:
        """Connect (within ``timeout``) and, unless ``hello=False``, check the server's version."""
        where = os.fspath(path)
        loop = asyncio.get_running_loop()
        try:
            _, link = await within(loop.create_unix_connection(_Link, where), timeout)
        except TimeoutError:
            raise IpcError(ErrorCode.UNAVAILABLE, f"timed out connecting to {where}") from None
        except OSError as exc:
            raise IpcError(
                ErrorCode.UNAVAILABLE, f"cannot connect to {where}: {exc.strerror or exc}"
            ) from None
        client = cls(where, link, protocol_major)
        if hello:
            try:
                result = await client.call(HELLO, {"v": protocol_major}, timeout=timeout)
                client.server_hello = check_hello(result, protocol_major, where)
            except BaseException:
                await client.close()
                raise
        return client

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        """True once the connection is unusable for calls."""
        return self._failure is not None

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Send one request and return its result; raise ``IpcError`` on an error response.

        ``timeout`` (seconds, None = no limit) raises ``IpcError(timeout)``; a
        late reply is then ignored. A lost connection raises
        ``IpcError(unavailable)`` for this and every later call.
        """
        if self._stream_id is not None:
            raise RuntimeError("this connection carries an event stream; open another for calls")
        return await self._request(self._take_id(), op, args, timeout)

    async def stream(
        self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> EventStream:
        """Open an event stream with a stream op; this connection is then dedicated to it."""
        if self._stream_id is not None:
            raise RuntimeError("this connection already carries an event stream")
        if self._pending:
            raise RuntimeError("stream() needs a connection with no calls in flight")
        rid = self._take_id()
        self._stream_id = rid
        try:
            # The ok response hands the link's later frames to the stream, in the same callback.
            result = await self._request(rid, op, args, timeout)
        except BaseException:
            await self.close()
            raise
        return EventStream(self, rid, result)

    async def close(self) -> None:
        """Close the connection; pending calls fail with ``unavailable``. Idempotent."""
        self._fail(IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the client"))
        self._transport.close()
        try:
            await within(asyncio.shield(self._link.lost), 1.0)
        except TimeoutError:
            self._transport.abort()

    # -- internals ---------------------------------------------------------

    def _take_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    async def _request(self, rid: int, op: str, args: dict[str, Any] | None, timeout: float | None) -> Any:
        if self._failure is not None:
            raise self._failure.copy()
        data = encode_frame(
            {"v": self.protocol_major, "id": rid, "op": op, "args": {} if args is None else args}
        )
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            try:
                written = self._write_now(data)
                if not written or self._link.write_paused:
                    await self._send(b"" if written else data)  # b"": written, only the drain is left
            except IpcError:
                refusal = fut.exception() if fut.done() and not fut.cancelled() else None
                if refusal is not None:
                    raise refusal from None  # e.g. the server's refusal, read meanwhile
                raise
            if timeout is None:
                return await fut
            try:
                return await within(fut, timeout)
            except TimeoutError:
                raise IpcError(
                    ErrorCode.TIMEOUT, f"{op} on {self.path}: no reply within {timeout} s"
                ) from None
        finally:
            self._pending.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved (we may have raised another error for it)

    def _write_now(self, data: bytes) -> bool:
        """Write ``data`` at once when no writer waits for a drain (the common case: a request then
        costs no lock and no drain coroutine); False: ``_send`` it."""
        if self._failure is not None or self._write_lock.locked() or self._transport.is_closing():
            return False
        self._transport.write(data)
        return True

    async def _send(self, data: bytes) -> None:
        async with self._write_lock:
            if self._failure is not None:
                raise self._failure.copy()
            if data:
                self._transport.write(data)
            try:
                await self._link.drain()
            except (ConnectionClosed, OSError) as exc:
                lost = IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} lost: {exc}")
                self._fail(lost)
                raise lost.copy() from None

    def _fail(self, error: IpcError) -> None:
        """Mark the connection unusable: pending calls fail with ``error``, later ones
        with ``unavailable`` (naming the reason)."""
        if self._failure is None:
            self.closed_by = error.copy()
            if error.code == ErrorCode.UNAVAILABLE:
                self._failure = error.copy()
            else:
                self._failure = IpcError(
                    ErrorCode.UNAVAILABLE, f"connection to {self.path} is closed after: {error.message}"
                )
            if not self._link.streaming:
                self._transport.close()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error.copy())
        self._pending.clear()

    def _route(self, frame: dict[str, Any]) -> bool:
        """Resolve the future a response belongs to; True when the stream takes over."""
        rid = frame.get("id")
        ok = frame.get("ok") is True
        if rid is None:
            if frame.get("ok") is False:  # connection-level refusal (permission, limits)
                raise IpcError.from_wire(frame.get("error"))
            raise InvalidFrame("frame without a request id on a call connection")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise InvalidFrame(f"response id {rid!r:.50} is not one of ours")
        fut = self._pending.get(rid)
        if fut is not None and not fut.done():  # else: a late reply to a timed-out call
            if ok:
                fut.set_result(frame.get("result"))
            else:
                fut.set_exception(IpcError.from_wire(frame.get("error")))
        return ok and rid == self._stream_id


class EventStream:
    """The events of a stream op, from the dedicated connection's queue.

    A frame holds one event (``{seq, kind, data}``) or, from a server asked for them (the control
    server's ``attach`` with ``batched``), several (``{events: [[seq, kind, data], ...]}``, in
    order): either way the stream yields events one by one, and ``batch`` returns them in bulk."""

    def __init__(self, client: AsyncClient, request_id: int, result: Any) -> None:
        self.result = result
        self._client = client
        self._request_id = request_id
        self._finished = False
        self._failed: IpcError | None = None  # a bad frame behind the events ``batch`` returned
        self._ready: deque[Event] = deque()  # events of a frame already taken, not yet returned

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        event = await self._next_event()
        if event is None:
            raise StopAsyncIteration
        return event

    async def batch(self, limit: int) -> list[Event]:
        """Wait for the next event, then take the events already received with it: at most
        ``limit``, in order, one wake-up for all of them (a consumer that stores events in batches
        needs no reader task or queue of its own). ``[]`` once the stream has ended; the error that
        ended it is raised by the call after the one that returned the events before it.
        Cancelling the wait loses nothing."""
        if limit < 1:
            raise ValueError(f"batch limit must be >= 1, not {limit}")
        first = await self._next_event()
        if first is None:
            return []
        events = [first]
        ready = self._ready
        while len(events) < limit:
            if not ready:
                frames = self._client._link.take_frames(1) if self._failed is None else None
                if not frames:
                    break
                try:
                    ready.extend(self._events(frames[0]))
                except IpcError as exc:  # the events before it are delivered; the next call raises it
                    self._failed = exc
                    break
                continue
            while ready and len(events) < limit:
                events.append(ready.popleft())
        return events

    async def frames(self, limit: int) -> list[dict[str, Any]]:
        """Wait for the next frame, then take the frames already received with it (at most
        ``limit``, in order), undecoded into events: for a stream whose frames say more than an
        event (the control server's ``attach_many``). ``[]`` once the stream has ended; the error
        that ended the connection is raised; a frame saying the stream ended with an error
        (``{ok: false, error}``) is returned like the others, for the caller to raise. Not to be
        mixed with ``batch`` on one stream."""
        if self._finished:
            return []
        item = await self._client._link.next_stream_item()
        if item is _END:
            await self.close()
            return []
        if isinstance(item, IpcError):
            await self.close()
            raise item
        return [item, *self._client._link.take_frames(limit - 1)]

    async def _next_event(self) -> Event | None:
        """The next event, waiting for it; None once the stream has ended. The error that ended it
        (the server's, or a malformed frame) is raised once. Either way the stream is then closed.
        Cancelling the wait loses nothing."""
        if self._finished:
            return None
        while not self._ready:
            if self._failed is not None:  # left by ``batch`` behind the events it returned
                await self.close()
                raise self._failed
            item = await self._client._link.next_stream_item()
            if item is _END:
                await self.close()
                return None
            try:
                if isinstance(item, IpcError):
                    raise item
                self._ready.extend(self._events(item))  # (a batch may be empty: then the next frame)
            except BaseException:
                await self.close()
                raise
        return self._ready.popleft()

    def _events(self, frame: dict[str, Any]) -> list[Event]:
        """The events of one stream frame, in order; ``InvalidFrame`` for a malformed one."""
        if "events" not in frame:
            return [self._event(frame)]
        return batch_events(frame["events"])

    def _event(self, frame: dict[str, Any]) -> Event:
        if "seq" in frame:
            seq, kind = frame.get("seq"), frame.get("kind")
            if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(kind, str):
                raise InvalidFrame("event frame with a malformed seq or kind")
            return Event(seq, kind, frame.get("data"))
        if frame.get("ok") is False and frame.get("id") in (self._request_id, None):
            raise IpcError.from_wire(frame.get("error"))  # the stream ended with an error
        raise InvalidFrame("unexpected frame on an event stream")

    async def close(self) -> None:
        """Close the stream's connection. Idempotent."""
        self._finished = True
        await self._client.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
