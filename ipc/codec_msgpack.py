"""The msgpack codec of frame bodies: what every kandev peer speaks.

``encode_frame`` turns a map into a whole frame (the length prefix of ``ipc.framing`` included);
``decode_body`` turns a body back into a map, defensively: ``raw=False``, ``strict_map_key=True``,
bounded lengths and no ext types (the built-in timestamp included), and anything that is not a map
is refused with ``InvalidFrame``. ``ipc.codec_json`` is the other codec, with the same names.
``read_frame``, ``read_frame_sync`` and ``write_frame_sync`` read and write one msgpack frame on an
asyncio stream or a blocking socket (tests and simple peers; the clients and the server use
``ipc.framing.FrameBuffer``).
"""

from __future__ import annotations

from _thread import _local as thread_local  # threading.local, without importing threading

import msgpack

from .errors import ErrorCode, IpcError
from .framing import (
    HEADER_SIZE,
    MAX_FRAME,
    ConnectionClosed,
    InvalidFrame,
    frame_length,
    frame_of,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    import asyncio
    import socket
    from typing import Any


def _refuse_ext(code: int, data: bytes) -> Any:
    raise InvalidFrame(f"msgpack ext type {code} is not allowed")


_packers = thread_local()


def _packer() -> msgpack.Packer:
    """This thread's packer: ``msgpack.packb`` builds a new one per call, which cost as much again
    as the packing of a small frame."""
    try:
        packer: msgpack.Packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer


def encode_frame(obj: dict[str, Any]) -> bytes:
    """Encode one map as a complete frame (length prefix included).

    Raises ``FrameTooLarge`` when the body would exceed ``MAX_FRAME`` and
    ``IpcError(invalid_argument)`` when ``obj`` is not a map or holds a value
    msgpack cannot encode.
    """
    if not isinstance(obj, dict):
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"a frame must be a map, not {type(obj).__name__}")
    try:
        body: bytes = _packer().pack(obj)  # a failed pack leaves the packer empty (autoreset)
    except (TypeError, ValueError, OverflowError) as exc:
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"value cannot be encoded: {exc}") from None
    return frame_of(body)


def pack(obj: Any) -> bytes:
    """``obj`` in msgpack, as ``encode_frame`` packs a frame's values (this thread's packer, not a
    new one per call); raises what msgpack raises for a value it cannot encode."""
    data: bytes = _packer().pack(obj)
    return data


def packed_size(obj: Any) -> int:
    """How many bytes msgpack encodes ``obj`` into, as ``encode_frame`` packs it."""
    return len(pack(obj))


_SEQ_KEY = b"\x83" + msgpack.packb("seq")  # a map of three entries, its first key
_KIND_KEY = msgpack.packb("kind")
_DATA_KEY = msgpack.packb("data")


def event_frame(seq: int, kind: str, packed_data: bytes) -> bytes:
    """The frame ``encode_frame({"seq": seq, "kind": kind, "data": data})`` writes, made from
    ``packed_data = pack(data)`` packed earlier: a msgpack map is its keys' and values' encodings
    one after the other, so a producer that packed an event's data once (to check its size) does
    not pack it again for every stream it goes out on."""
    packer = _packer()
    return frame_of(b"".join((_SEQ_KEY, packer.pack(seq), _KIND_KEY, packer.pack(kind), _DATA_KEY, packed_data)))


_EVENTS_KEY = b"\x81" + msgpack.packb("events")  # a map of one entry, its key
_EVENT_ITEM = b"\x93"  # an array of three: seq, kind, data


_INSTANCE_KEY = b"\x82" + msgpack.packb("instance")  # a map of two entries, its first key
_EVENTS_AFTER_INSTANCE = msgpack.packb("events")


def event_batch_frames(events: list[tuple[int, str, bytes]], max_bytes: int, *, tag: str | None = None
                       ) -> list[bytes]:
    """The frames ``encode_frame({"events": [[seq, kind, data], ...]})`` writes for ``events``
    (each ``(seq, kind, pack(data))``, in order), as few as hold them with at most ``max_bytes`` of
    events in each (an event larger than that goes alone in its frame). One frame for many events:
    the peer decodes them in one call instead of a frame each. With ``tag`` (a stream that carries
    the events of many sources), ``encode_frame({"instance": tag, "events": [...]})``."""
    packer = _packer()
    head = _EVENTS_KEY if tag is None else b"".join((_INSTANCE_KEY, packer.pack(tag), _EVENTS_AFTER_INSTANCE))
    batches: list[list[bytes]] = []
    items: list[bytes] = []
    size = 0
    for seq, kind, packed_data in events:
        item = b"".join((_EVENT_ITEM, packer.pack(seq), packer.pack(kind), packed_data))
        if items and size + len(item) > max_bytes:
            batches.append(items)
            items, size = [], 0
        items.append(item)
        size += len(item)
    if items:
        batches.append(items)
    return [frame_of(b"".join((head, packer.pack_array_header(len(b)), *b))) for b in batches]


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a frame body (without its prefix) into a map, or raise ``InvalidFrame``."""
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_ext_len=0,  # refuses the built-in timestamp ext too
        )
    except InvalidFrame:
        raise
    except Exception as exc:  # FormatError, StackError, ExtraData, ValueError, ...
        raise InvalidFrame(f"frame body is not valid msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidFrame(f"frame body is a {type(obj).__name__}, not a map")
    return obj


async def read_frame(reader: asyncio.StreamReader, max_size: int = MAX_FRAME) -> dict[str, Any] | None:
    """Read one msgpack frame; ``None`` on a clean EOF at a frame boundary.

    Raises ``FrameTooLarge`` (the body is not read: the stream cannot be
    resynchronised), ``InvalidFrame`` (the body was consumed, the stream is
    still in sync) or ``ConnectionClosed`` (EOF or reset mid-frame).
    """
    import asyncio

    try:
        header = await reader.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionClosed("connection closed in the middle of a frame header") from None
    except ConnectionError as exc:
        raise ConnectionClosed(f"connection lost: {exc}") from None
    size = frame_length(header, max_size)
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionClosed(
            f"connection closed in the middle of a frame ({len(exc.partial)} of {size} bytes)"
        ) from None
    except ConnectionError as exc:
        raise ConnectionClosed(f"connection lost: {exc}") from None
    return decode_body(body)


def _recv_exactly(sock: socket.socket, size: int, *, started: bool) -> bytes | None:
    """Receive exactly ``size`` bytes; ``None`` on EOF before the first byte.

    A timeout before any byte of the frame propagates as ``TimeoutError`` (the
    stream is still in sync). A timeout after part of the frame was consumed
    becomes ``ConnectionClosed`` chained from the ``TimeoutError``: the
    stream is out of sync and the caller must drop the connection.
    """
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as exc:
            if got == 0 and not started:
                raise
            raise ConnectionClosed("timed out in the middle of a frame") from exc
        except OSError as exc:
            raise ConnectionClosed(f"connection lost: {exc}") from None
        if n == 0:
            if got == 0 and not started:
                return None
            raise ConnectionClosed(f"connection closed in the middle of a frame ({got} of {size} bytes)")
        got += n
    return bytes(buf)


def read_frame_sync(sock: socket.socket, max_size: int = MAX_FRAME) -> dict[str, Any] | None:
    """Blocking ``read_frame`` for a plain socket (honours the socket's timeout)."""
    header = _recv_exactly(sock, HEADER_SIZE, started=False)
    if header is None:
        return None
    size = frame_length(header, max_size)
    body = _recv_exactly(sock, size, started=True)
    assert body is not None
    return decode_body(body)


def write_frame_sync(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Encode ``obj`` and send the whole frame on a blocking socket.

    A ``TimeoutError`` propagates; part of the frame may have been sent, so
    the caller must drop the connection.
    """
    data = encode_frame(obj)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise
    except OSError as exc:
        raise ConnectionClosed(f"connection lost: {exc}") from None
