"""The asyncio client: multiplexed calls and event streams over one socket.

``AsyncClient.call`` sends a request and awaits its response; any number of
calls may be in flight on one connection, matched to their responses by
request id by a background reader task. ``AsyncClient.stream`` turns a
connection into an event stream: after the stream op's ok response the
connection belongs to the returned ``EventStream``, which reads event frames
only when iterated (so a slow consumer applies backpressure to the server).

The blocking client for the CLI lives in ``ipc.sync_client`` and is
re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

from ipc.aio import within

from .errors import ErrorCode, IpcError
from .framing import (
    HEADER_SIZE,
    MAX_FRAME,
    ConnectionClosed,
    InvalidFrame,
    decode_body,
    encode_frame,
    frame_length,
    read_frame,
)
from .hello import HELLO, check_hello
from .sync_client import SyncClient

__all__ = ["AsyncClient", "Event", "EventStream", "SyncClient"]

log = logging.getLogger(__name__)

_READ_LIMIT = 256 * 1024


@dataclass(frozen=True)
class Event:
    """One ``{seq, kind, data}`` frame of an event stream."""

    seq: int
    kind: str
    data: Any


def _copy(error: IpcError) -> IpcError:
    """A fresh exception with the same wire content (never re-raise a shared instance)."""
    return IpcError(error.code, error.message, error.retryable)


class AsyncClient:
    """One connection to an ``IpcServer``. Create it with ``await AsyncClient.connect(path)``."""

    def __init__(
        self,
        path: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        protocol_major: int,
    ) -> None:
        self.path = path
        self.protocol_major = protocol_major
        self.server_hello: dict[str, Any] | None = None
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 1
        self._write_lock = asyncio.Lock()
        self._failure: IpcError | None = None
        self.closed_by: IpcError | None = None  # the error that ended the connection, as it came
        self._stream_id: int | None = None
        self._handed_off = False
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

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
        try:
            reader, writer = await within(
                asyncio.open_unix_connection(where, limit=_READ_LIMIT), timeout
            )
        except TimeoutError:
            raise IpcError(ErrorCode.UNAVAILABLE, f"timed out connecting to {where}") from None
        except OSError as exc:
            raise IpcError(
                ErrorCode.UNAVAILABLE, f"cannot connect to {where}: {exc.strerror or exc}"
            ) from None
        client = cls(where, reader, writer, protocol_major)
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
            result = await self._request(rid, op, args, timeout)
            await self._read_task  # it stops right after delivering our ok response
        except BaseException:
            await self.close()
            raise
        return EventStream(self, rid, result)

    async def close(self) -> None:
        """Close the connection; pending calls fail with ``unavailable``. Idempotent."""
        self._fail(IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the client"))
        if not self._read_task.done():
            self._read_task.cancel()
            try:
                await self._read_task
            except asyncio.CancelledError:
                pass
        self._writer.close()
        try:
            await within(self._writer.wait_closed(), 1.0)
        except (TimeoutError, OSError):
            pass

    # -- internals ---------------------------------------------------------

    def _take_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    async def _request(self, rid: int, op: str, args: dict[str, Any] | None, timeout: float | None) -> Any:
        if self._failure is not None:
            raise _copy(self._failure)
        data = encode_frame(
            {"v": self.protocol_major, "id": rid, "op": op, "args": {} if args is None else args}
        )
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            try:
                written = self._write_now(data)
                if not written or self._writer.transport.get_write_buffer_size():
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
        costs no lock and no drain coroutines); False: ``_send`` it."""
        if self._failure is not None or self._write_lock.locked() or self._writer.transport.is_closing():
            return False
        self._writer.write(data)
        return True

    async def _send(self, data: bytes) -> None:
        async with self._write_lock:
            if self._failure is not None:
                raise _copy(self._failure)
            self._writer.write(data)
            try:
                await self._writer.drain()
            except OSError as exc:
                lost = IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} lost: {exc}")
                self._fail(lost)
                raise _copy(lost) from None

    def _fail(self, error: IpcError) -> None:
        """Mark the connection unusable: pending calls fail with ``error``, later ones
        with ``unavailable`` (naming the reason)."""
        if self._failure is None:
            self.closed_by = _copy(error)
            if error.code == ErrorCode.UNAVAILABLE:
                self._failure = _copy(error)
            else:
                self._failure = IpcError(
                    ErrorCode.UNAVAILABLE, f"connection to {self.path} is closed after: {error.message}"
                )
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(_copy(error))
        self._pending.clear()

    async def _read_loop(self) -> None:
        failure = IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the server")
        try:
            while True:
                frame = await read_frame(self._reader, MAX_FRAME)
                if frame is None:
                    break
                if self._route(frame):
                    self._handed_off = True
                    return
        except IpcError as exc:
            if exc.code == ErrorCode.UNAVAILABLE:
                failure = IpcError(exc.code, f"connection to {self.path} lost: {exc.message}")
            else:
                failure = _copy(exc)
        except asyncio.CancelledError:
            failure = IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the client")
            raise
        except Exception as exc:  # a bug here must not leave callers hanging
            log.exception("ipc client %s: reader failed", self.path)
            failure = IpcError(ErrorCode.INTERNAL, f"client reader failed: {exc}")
        finally:
            if not self._handed_off:
                self._fail(failure)
                self._writer.close()

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
    """The events of a stream op, read lazily from the dedicated connection."""

    def __init__(self, client: AsyncClient, request_id: int, result: Any) -> None:
        self.result = result
        self._client = client
        self._request_id = request_id
        self._finished = False
        self._size: int | None = None  # body size of a frame whose header was read

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._finished:
            raise StopAsyncIteration
        try:
            frame = await self._read_frame()
        except asyncio.CancelledError:
            raise  # nothing half-read was lost: iterating again resumes the stream
        except BaseException:
            await self.close()
            raise
        if frame is None:
            await self.close()
            raise StopAsyncIteration
        try:
            return self._event(frame)
        except BaseException:
            await self.close()
            raise

    async def _read_frame(self) -> dict[str, Any] | None:
        """``read_frame``, but safe to cancel: a header already read is kept for the next call."""
        reader = self._client._reader
        try:
            if self._size is None:
                header = await reader.readexactly(HEADER_SIZE)  # consumes nothing unless complete
                self._size = frame_length(header, MAX_FRAME)
            body = await reader.readexactly(self._size)
        except asyncio.IncompleteReadError as exc:
            if self._size is None and not exc.partial:
                return None  # the server closed at a frame boundary: the stream is over
            raise ConnectionClosed(
                f"connection to {self._client.path} closed in the middle of a frame"
            ) from None
        except ConnectionError as exc:
            raise ConnectionClosed(f"connection to {self._client.path} lost: {exc}") from None
        self._size = None
        return decode_body(body)

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
