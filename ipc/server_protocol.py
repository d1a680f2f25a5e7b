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
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from .errors import IpcError
from .framing import FrameBuffer, FrameTooLarge, InvalidFrame, encode_frame

if TYPE_CHECKING:
    from .connection import ConnectionContext

_DISCARD = memoryview(bytearray(64 * 1024))  # scratch space for a refused peer's input


def error_frame(rid: Any, error: IpcError) -> bytes:
    """An encoded error response (``rid`` None for connection-level errors)."""
    return encode_frame({"id": rid, "ok": False, "error": error.to_wire()})


class Dispatcher(Protocol):
    """What a ``ServerProtocol`` needs from its server."""

    def admit(self, transport: asyncio.Transport) -> ConnectionContext | None: ...

    def dispatch(self, conn: ServerProtocol, ctx: ConnectionContext, frame: dict[str, Any]) -> None: ...

    def forget(self, ctx: ConnectionContext) -> None: ...


class ServerProtocol(asyncio.BufferedProtocol):
    """One accepted connection's reading side."""

    def __init__(
        self, dispatcher: Dispatcher, max_frame: int, max_inflight: int, frame_timeout: float
    ) -> None:
        self._dispatcher = dispatcher
        self._frames = FrameBuffer(max_frame)
        self._max_inflight = max_inflight
        self._frame_timeout = frame_timeout
        self._frame_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None
        self.ctx: ConnectionContext | None = None
        self.inflight = 0
        self._reading_paused = False
        self._done = False  # refused, EOF, or unrecoverable: ignore further input

    # -- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.ctx = self._dispatcher.admit(transport)
        if self.ctx is None:
            self._done = True

    def get_buffer(self, sizehint: int) -> memoryview:
        # refused, or closed by a hand-over: what the peer still sends while we linger is discarded
        if self.ctx is None or self.ctx._discarding:
            return _DISCARD
        return self._frames.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self.ctx is None or self.ctx._discarding:
            return
        self._frames.buffer_updated(nbytes)
        if not self._done:
            self.process()

    def eof_received(self) -> bool:
        self._done = True
        self._stop_frame_timer()
        ctx = self.ctx
        if ctx is None:
            return False
        ctx.closed.set()
        self._cancel_stream()
        # A peer that only half-closed still gets the responses in flight;
        # task_done closes the connection after the last one.
        return self.inflight > 0 and ctx._stream_task is None

    def pause_writing(self) -> None:
        if self.ctx is not None:
            self.ctx._pause_writing()

    def resume_writing(self) -> None:
        if self.ctx is not None:
            self.ctx._resume_writing()
            if not self._done:
                self.process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._done = True
        self._stop_frame_timer()
        ctx = self.ctx
        if ctx is not None:
            ctx._connection_lost()
            self._cancel_stream()
            self._dispatcher.forget(ctx)

    # -- frames ------------------------------------------------------------

    def process(self) -> None:
        """Handle every complete frame buffered, as far as flow control allows."""
        ctx = self.ctx
        assert ctx is not None
        frames = self._frames
        while not self._done and not ctx._closing:
            streaming = ctx._stream_task is not None
            if not streaming and (self.inflight >= self._max_inflight or ctx._write_paused):
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
                if not ctx._streaming:
                    ctx._send_soon(error_frame(None, exc))
                ctx.close()
                return
            except InvalidFrame as exc:  # the frame was consumed: still in sync
                ctx._send_soon(error_frame(None, exc))
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
        if not ctx._streaming:
            ctx._send_soon(error_frame(None, error))
        ctx.close()

    def _stop_frame_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def task_done(self) -> None:
        """Called by each handler task as it ends: one more request may run."""
        self.inflight -= 1
        if not self._done:
            if self._reading_paused:
                self.process()
        elif self.inflight == 0 and self.ctx is not None:
            self.ctx.close()  # after EOF: the last response is written

    # -- internals ---------------------------------------------------------

    def _cancel_stream(self) -> None:
        ctx = self.ctx
        if ctx is not None and ctx._stream_task is not None and not ctx._stream_task.done():
            ctx._stream_task.cancel()  # its peer is gone

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
