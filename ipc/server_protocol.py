"""Reading one server connection: bytes in, frames out, with read-side flow control.

``ServerProtocol`` is the ``asyncio.BufferedProtocol`` behind each accepted
connection. It receives into a reusable ``FrameBuffer`` (no per-read
allocation), splits frames, refuses the ones that cannot be decoded, and
hands good ones to its ``Dispatcher`` (the ``IpcServer``). It stops reading
while the connection has ``max_inflight`` requests running or while the
peer is not reading our responses, and it discards requests once a stream
op was dispatched (but keeps reading, to notice the peer leaving). A frame
that has begun must be complete within ``frame_timeout`` seconds of reading
time, or the connection is refused with ``invalid_frame`` and closed: a
half-sent frame cannot hold a connection slot forever.

Two more bounds hold against admitted peers that misbehave. A connection
with no request in flight that sent nothing for ``idle_timeout`` seconds
(since its last byte or its last response) is told ``idle_timeout`` and
closed, unless it carries a stream or the server's ``idle_exempt`` says it
may stay (e.g. it authenticated as the owner). Receive buffers grow only
with the bytes that arrived and are charged to the server's shared
``BufferBudget``; a frame that would take the total past the cap is refused
with ``buffers_full`` (a lingering close, so the peer reads why) and the
connection is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from . import codec_json, codec_msgpack
from .errors import ErrorCode, IpcError
from .framing import BufferBudget, BufferLimitExceeded, FrameBuffer, FrameTooLarge, InvalidFrame

if TYPE_CHECKING:
    from .connection import ConnectionContext
    from .framing import Codec

_DISCARD = memoryview(bytearray(64 * 1024))  # scratch space for a refused peer's input
REFUSAL_LINGER_S = 1.0  # seconds a refused connection stays half-open for the peer to read why
INITIAL_BUFFER = 16 * 1024  # a connection's receive buffer before a frame needs more


@dataclass(frozen=True)
class ConnectionLimits:
    """The per-connection bounds a server applies (see the module doc)."""

    max_frame: int
    max_inflight: int
    frame_timeout: float
    idle_timeout: float | None = None  # None: connections may stay idle
    idle_exempt: Callable[[ConnectionContext], bool] | None = None
    accept_json: bool = False  # a peer whose first frame is JSON is answered in JSON (ipc.codec_json)


def error_frame(rid: Any, error: IpcError, codec: Codec) -> bytes:
    """An encoded error response in ``codec`` (``rid`` None for connection-level errors)."""
    return codec.encode_frame({"id": rid, "ok": False, "error": error.to_wire()})


class Dispatcher(Protocol):
    """What a ``ServerProtocol`` needs from its server."""

    def admit(self, transport: asyncio.Transport) -> ConnectionContext | None: ...

    def dispatch(self, conn: ServerProtocol, ctx: ConnectionContext, frame: dict[str, Any]) -> None: ...

    def forget(self, ctx: ConnectionContext) -> None: ...


class ServerProtocol(asyncio.BufferedProtocol):
    """One accepted connection's reading side."""

    def __init__(self, dispatcher: Dispatcher, limits: ConnectionLimits, budget: BufferBudget) -> None:
        self._dispatcher = dispatcher
        self._limits = limits
        self._frames = FrameBuffer(limits.max_frame, INITIAL_BUFFER, budget=budget, decode=codec_msgpack.decode_body)
        self._max_inflight = limits.max_inflight
        self._frame_timeout = limits.frame_timeout
        self._frame_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._last_active = 0.0  # loop time of the last byte read or response finished
        self._transport: asyncio.Transport | None = None
        self.ctx: ConnectionContext | None = None
        self.inflight = 0
        self._reading_paused = False
        self._done = False  # refused, EOF, or unrecoverable: ignore further input
        self._discarding = False  # refused mid-frame: what the peer still sends is dropped

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self._transport = transport
        self.ctx = self._dispatcher.admit(transport)
        if self.ctx is None:
            self._done = True
            return
        if self._limits.accept_json:
            self._frames.decode = self._decode_first
        if self._limits.idle_timeout is not None:
            loop = asyncio.get_running_loop()
            self._last_active = loop.time()
            self._idle_timer = loop.call_later(self._limits.idle_timeout, self._idle_check)

    @property
    def _dropping_input(self) -> bool:
        """Whether what the peer sends is read and dropped: the connection was refused at once,
        refused mid-frame (``buffers_full``), or is lingering after a hand-over closed it
        (``ConnectionContext.linger``)."""
        return self.ctx is None or self._discarding or self.ctx.discarding

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dropping_input:  # refused, or closed by a hand-over: what the peer still sends is discarded
            return _DISCARD
        try:
            return self._frames.get_buffer(sizehint)
        except BufferLimitExceeded as exc:
            self._refuse_mid_frame(exc)
            return _DISCARD

    def buffer_updated(self, nbytes: int) -> None:
        if self._dropping_input:
            return
        self._frames.buffer_updated(nbytes)
        if self._idle_timer is not None:
            self._last_active = asyncio.get_running_loop().time()
        if not self._done:
            self.process()

    def eof_received(self) -> bool:
        self._done = True
        self._stop_frame_timer()
        self._stop_idle_timer()
        if self._dropping_input:
            return False
        ctx = self.ctx
        if ctx is None:
            return False
        ctx.closed.set()
        self._cancel_stream()
        # A peer that only half-closed still gets the responses in flight;
        # task_done closes the connection after the last one.
        return self.inflight > 0 and ctx.stream_task is None

    def pause_writing(self) -> None:
        if self.ctx is not None:
            self.ctx.pause_writing()

    def resume_writing(self) -> None:
        if self.ctx is not None:
            self.ctx.resume_writing()
            if not self._done:
                self.process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._done = True
        self._stop_frame_timer()
        self._stop_idle_timer()
        self._frames.close()  # its bytes go back to the server's budget
        ctx = self.ctx
        if ctx is not None:
            ctx.connection_lost()
            self._cancel_stream()
            self._dispatcher.forget(ctx)

    # -- frames ------------------------------------------------------------

    def _decode_first(self, body: bytes | memoryview) -> dict[str, Any]:
        """Decode the first frame of a server that accepts JSON: its first byte chooses the
        connection's codec (``ipc.codec_json``), both ways, for the rest of the connection."""
        codec: Codec = codec_json if body and body[0] == codec_json.FIRST_BYTE else codec_msgpack
        assert self.ctx is not None
        self.ctx.codec = codec
        self._frames.decode = codec.decode_body
        return codec.decode_body(body)

    def process(self) -> None:
        """Handle every complete frame buffered, as far as flow control allows."""
        ctx = self.ctx
        assert ctx is not None
        frames = self._frames
        while not self._done and not ctx.closing:
            streaming = ctx.stream_task is not None
            if not streaming and (self.inflight >= self._max_inflight or ctx.write_paused):
                self._pause_reading()  # our doing, not the peer's: no incomplete-frame clock
                self._stop_frame_timer()
                return
            try:
                if streaming:  # a stream connection carries no more requests: read to see EOF
                    if frames.skip_frame():
                        continue
                    break
                frame = frames.next_frame()
            except FrameTooLarge as exc:  # the body was not read: cannot resynchronise
                self._done = True
                if not ctx.streaming:
                    ctx.send_soon(error_frame(None, exc, ctx.codec))
                ctx.close()
                return
            except InvalidFrame as exc:  # the frame was consumed: still in sync
                ctx.send_soon(error_frame(None, exc, ctx.codec))
                continue
            if frame is None:
                break
            self._dispatcher.dispatch(self, ctx, frame)
        if self._frames.pending and not self._done:
            if self._frame_timer is None:  # a frame has begun: it must be complete in time
                loop = asyncio.get_running_loop()
                self._frame_timer = loop.call_later(self._frame_timeout, self._frame_timed_out)
        elif self._frame_timer is not None:
            self._stop_frame_timer()
        self._resume_reading()

    def _frame_timed_out(self) -> None:
        """A peer started a frame and did not finish it: refuse and close (it cannot resync)."""
        self._frame_timer = None
        ctx = self.ctx
        if self._done or ctx is None or not self._frames.pending:
            return
        self._done = True
        error = InvalidFrame(
            f"incomplete frame: {self._frames.pending} bytes, then nothing for {self._frame_timeout:g} s"
        )
        if not ctx.streaming:
            ctx.send_soon(error_frame(None, error, ctx.codec))
        ctx.close()

    def _stop_frame_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _idle_check(self) -> None:
        """Close the connection if it has been idle for the idle timeout, else look again later."""
        self._idle_timer = None
        ctx, timeout = self.ctx, self._limits.idle_timeout
        if self._done or ctx is None or ctx.closing or timeout is None:
            return
        if ctx.stream_task is not None:
            return  # a stream connection is never idle: it lives as long as its stream
        loop = asyncio.get_running_loop()
        exempt = self._limits.idle_exempt
        busy = self.inflight > 0 or self._frames.pending > 0  # a begun frame has its own timer
        if busy or (exempt is not None and exempt(ctx)):
            self._idle_timer = loop.call_later(timeout, self._idle_check)
            return
        quiet = loop.time() - self._last_active
        if quiet < timeout:
            self._idle_timer = loop.call_later(timeout - quiet, self._idle_check)
            return
        self._done = True
        error = IpcError(ErrorCode.IDLE_TIMEOUT, f"no request for {timeout:g} s: connection closed; reconnect")
        ctx.send_soon(error_frame(None, error, ctx.codec))
        ctx.close()

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _refuse_mid_frame(self, error: IpcError) -> None:
        """Refuse a frame we cannot buffer: the typed error, then a lingering close (we stop
        reading its bytes, so the peer could not resynchronise anyway)."""
        ctx, transport = self.ctx, self._transport
        assert ctx is not None and transport is not None
        self._done = True
        self._discarding = True
        self._stop_frame_timer()
        self._stop_idle_timer()
        self._frames.close()
        if not ctx.streaming:
            ctx.send_soon(error_frame(None, error, ctx.codec))
        if transport.can_write_eof() and not ctx.write_paused:
            # Half-close so the peer reads the refusal and EOF, and drop its input for a moment:
            # closing with its unread bytes queued would reset the connection and lose the refusal.
            transport.write_eof()
            self._resume_reading()
            asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, ctx.close)
        else:
            ctx.close()

    def task_done(self) -> None:
        """Called by each handler task as it ends: one more request may run."""
        self.inflight -= 1
        if self._idle_timer is not None:
            self._last_active = asyncio.get_running_loop().time()
        if not self._done:
            if self._reading_paused:
                self.process()
        elif self.inflight == 0 and self.ctx is not None:
            self.ctx.close()  # after EOF: the last response is written

    # -- internals ---------------------------------------------------------

    def _cancel_stream(self) -> None:
        ctx = self.ctx
        if ctx is not None and ctx.stream_task is not None and not ctx.stream_task.done():
            ctx.stream_task.cancel()  # its peer is gone

    def _pause_reading(self) -> None:
        transport = self._transport
        if not self._reading_paused and transport is not None and not transport.is_closing():
            transport.pause_reading()
            self._reading_paused = True

    def _resume_reading(self) -> None:
        transport = self._transport
        if self._reading_paused and transport is not None and not transport.is_closing():
            transport.resume_reading()
            self._reading_paused = False
