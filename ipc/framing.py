"""Wire framing: a 4-byte big-endian length, then one body: a msgpack map, or a JSON object.

This module puts the length prefix around a body (``frame_of``) and splits byte streams into
frames, and nothing else; the bodies are the codecs' (``ipc.codec_msgpack``, every peer's;
``ipc.codec_json``, which a server may also accept from clients). Splitting is defensive: the
length prefix is checked against a limit before the body is read, and buffers grow with the bytes
that arrived (so a hostile prefix never makes us allocate). This module does not import msgpack: a
client that speaks JSON (the kandev CLI) never loads it.
"""

from __future__ import annotations

import struct

from .errors import ErrorCode, IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Protocol

    Decode = Callable[[bytes | memoryview], dict[str, Any]]
    """A codec's ``decode_body``: a frame body (without its prefix) to a map, or ``InvalidFrame``."""

    class Codec(Protocol):
        """A codec of frame bodies: the modules ``ipc.codec_msgpack`` and ``ipc.codec_json``."""

        def encode_frame(self, obj: dict[str, Any]) -> bytes: ...

        def decode_body(self, body: bytes | memoryview) -> dict[str, Any]: ...


MAX_FRAME = 8 * 1024 * 1024
"""Largest frame body, in bytes, that either side sends or accepts."""

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size


class FrameTooLarge(IpcError):
    """A length prefix (or an encoded message) above the frame limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(ErrorCode.FRAME_TOO_LARGE, f"frame of {size} bytes exceeds the {limit} byte limit")
        self.size = size
        self.limit = limit


class InvalidFrame(IpcError):
    """A frame whose body its codec cannot decode into one map."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INVALID_FRAME, message)


class ConnectionClosed(IpcError):
    """The peer went away (possibly in the middle of a frame)."""

    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


def frame_of(body: bytes) -> bytes:
    """The complete frame of an encoded body (its length prefix first); ``FrameTooLarge`` when the
    body exceeds ``MAX_FRAME``."""
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(len(body), MAX_FRAME)
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes, max_size: int) -> int:
    """Parse a length prefix and check it against ``max_size``."""
    size: int = HEADER.unpack(header)[0]
    if size > max_size:
        raise FrameTooLarge(size, max_size)
    return size


class BufferLimitExceeded(IpcError):
    """Growing a receive buffer would take a server's buffers past their shared cap."""

    def __init__(self, wanted: int, limit: int) -> None:
        super().__init__(
            ErrorCode.BUFFERS_FULL,
            f"the server's receive buffers are full (a frame needed {wanted} more bytes; the cap for all"
            f" connections together is {limit} bytes); retry shortly",
        )


class BufferBudget:
    """The receive-buffer bytes all connections of one server may hold together.

    Each ``FrameBuffer`` of the server charges its capacity here. A buffer may always hold its
    ``initial`` size (so small requests keep being served while big frames are refused); growing
    beyond it is refused with ``BufferLimitExceeded`` once the total would pass ``limit``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("buffer limit must be >= 1")
        self.limit = limit
        self.used = 0

    def change(self, old: int, new: int, *, free_up_to: int) -> None:
        """Move one buffer's charge from ``old`` to ``new`` bytes; growth beyond ``free_up_to``
        (the buffer's initial size) must fit under the limit."""
        grow = new - max(old, free_up_to)
        if new > old and grow > 0 and self.used + grow > self.limit:
            raise BufferLimitExceeded(new - old, self.limit)
        self.used += new - old


class FrameBuffer:
    """Incremental frame splitter over one reusable receive buffer (sans I/O).

    Fill it with ``get_buffer()`` + ``recv_into`` + ``buffer_updated(n)``
    (the shape of ``asyncio.BufferedProtocol``, and of a blocking
    ``socket.recv_into`` loop), then take complete frames with
    ``next_frame()``. The buffer grows with the bytes that actually arrived
    (it at most doubles what is pending, and never exceeds the declared frame
    once a length prefix was checked against ``max_size``), so a peer that
    declares a large frame and sends little of it costs little; it shrinks
    back once the frame is consumed. Partial frames survive across reads, so a
    read timeout never loses sync.

    Nothing is allocated before the first byte arrives (a connection that never sends costs no
    buffer); after a frame the buffer keeps ``initial`` bytes for the next one. ``budget``: a
    ``BufferBudget`` shared by a server's connections (growth past its cap raises
    ``BufferLimitExceeded`` from ``get_buffer``). ``decode``: the codec's body decoder
    (``ipc.codec_msgpack.decode_body``, ``ipc.codec_json.decode_body``). Call ``close()`` when the
    connection ends.
    """

    def __init__(
        self,
        max_size: int = MAX_FRAME,
        initial: int = 64 * 1024,
        *,
        budget: BufferBudget | None = None,
        decode: Decode,
    ) -> None:
        if initial < 1:
            raise ValueError("initial buffer size must be >= 1")
        self.decode: Decode = decode
        """How ``next_frame`` decodes a body; a server may replace it once it knows the peer's codec."""
        self.max_size = max_size
        self._initial = initial
        self._budget = budget
        self._buf = bytearray()
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def pending(self) -> int:
        """Bytes received but not yet consumed as a frame (non-zero at EOF = truncated)."""
        return self._end - self._start

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds allocated now."""
        return len(self._buf)

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Free space to receive into (never empty). May raise ``BufferLimitExceeded``."""
        if self._end == len(self._buf):
            self._make_room()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the last ``get_buffer()``."""
        self._end += nbytes

    def close(self) -> None:
        """Free the buffer and return its charge to the budget (the connection ended)."""
        self._resize(0)
        self._start = self._end = 0

    def _make_room(self) -> None:
        pending = self._end - self._start
        want = max(self._initial, 2 * pending)  # grows with what arrived, never with what is declared
        if pending >= HEADER_SIZE:
            (size,) = HEADER.unpack_from(self._buf, self._start)
            frame = HEADER_SIZE + size
            if size <= self.max_size and frame > pending:  # an oversized prefix is refused by next_frame
                want = min(want, frame)
            elif frame <= pending:  # complete frames not consumed yet: make some space anyway
                want = pending + self._initial
        if self._start and want <= len(self._buf):  # room enough once compacted
            self._buf[:pending] = self._buf[self._start : self._end]
        else:
            self._resize(want, keep=pending)
        self._start, self._end = 0, pending

    def _resize(self, size: int, keep: int = 0) -> None:
        """Replace the buffer by one of ``size`` bytes holding the ``keep`` pending bytes."""
        old = len(self._buf)
        if self._budget is not None:
            self._budget.change(old, size, free_up_to=self._initial)
        new = bytearray(size)
        if keep:
            new[:keep] = self._view[self._start : self._start + keep]
        self._buf, self._view = new, memoryview(new)

    def _take_body(self) -> memoryview | None:
        """The next complete frame's body, consumed (the caller releases it), or None if more bytes
        are needed; ``FrameTooLarge`` for a prefix above the limit (nothing consumed). One method,
        no helpers below it: this runs twice per request on either side."""
        start = self._start
        available = self._end - start
        if available < HEADER_SIZE:
            return None
        size: int = HEADER.unpack_from(self._buf, start)[0]
        if size > self.max_size:
            raise FrameTooLarge(size, self.max_size)
        if available < HEADER_SIZE + size:
            return None
        begin = start + HEADER_SIZE
        self._start = end = begin + size
        return self._view[begin:end]

    def _consumed(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self._initial:  # drop a buffer grown for one big frame
                self._resize(self._initial)

    def next_frame(self) -> dict[str, Any] | None:
        """The next complete frame, or None if more bytes are needed.

        Raises ``FrameTooLarge`` (nothing consumed: the stream cannot be
        resynchronised) or ``InvalidFrame`` (the frame was consumed: the
        stream is still in sync).
        """
        body = self._take_body()
        if body is None:
            return None
        try:
            return self.decode(body)
        finally:
            body.release()
            self._consumed()

    def skip_frame(self) -> bool:
        """Consume the next complete frame without decoding it; False if incomplete."""
        body = self._take_body()
        if body is None:
            return False
        body.release()
        self._consumed()
        return True
