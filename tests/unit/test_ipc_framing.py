"""Unit tests for ipc.framing: round trips, refusals, truncation (real sockets, no mocks)."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import tracemalloc
from typing import Any

import msgpack
import pytest

from ipc.codec_msgpack import (
    decode_body,
    encode_frame,
    event_batch_frames,
    event_frame,
    pack,
    packed_size,
    read_frame,
    read_frame_sync,
    write_frame_sync,
)
from ipc.errors import ErrorCode, IpcError
from ipc.framing import (
    HEADER_SIZE,
    MAX_FRAME,
    BufferBudget,
    BufferLimitExceeded,
    ConnectionClosed,
    FrameBuffer,
    FrameTooLarge,
    InvalidFrame,
)
from tests.support.aio import run

pytestmark = pytest.mark.timeout(30)

SAMPLES: list[dict[str, Any]] = [
    {},
    {"v": 1, "id": 7, "op": "echo", "args": {"x": [1, 2, 3]}},
    {"bytes": b"\x00\xff" * 100, "str": "héllo ✓", "none": None, "t": True, "f": 1.5},
    {"big": 2**63 - 1, "neg": -(2**63), "nested": {"a": {"b": {"c": [{"d": []}]}}}},
    {"blob": b"x" * (1024 * 1024)},
]


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def reader_with(data: bytes, *, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def read_one(data: bytes, max_size: int = MAX_FRAME) -> dict[str, Any] | None:
    """read_frame on a StreamReader holding ``data`` then EOF (made inside the loop)."""

    async def main() -> dict[str, Any] | None:
        return await read_frame(reader_with(data), max_size)

    return run(main())


async def read_all(data: bytes) -> list[dict[str, Any]]:
    reader = reader_with(data)
    out = []
    while (frame := await read_frame(reader)) is not None:
        out.append(frame)
    return out


# -- encoding ----------------------------------------------------------------


def test_encode_frame_layout() -> None:
    data = encode_frame({"a": 1})
    (size,) = struct.unpack(">I", data[:4])
    assert size == len(data) - 4
    assert msgpack.unpackb(data[4:]) == {"a": 1}


def test_encode_uses_bin_type() -> None:
    data = encode_frame({"b": b"\x01\x02", "s": "x"})
    assert decode_body(data[4:]) == {"b": b"\x01\x02", "s": "x"}
    assert isinstance(decode_body(data[4:])["b"], bytes)


def test_encode_refuses_non_map() -> None:
    for bad in ([1, 2], "x", 3, None):
        with pytest.raises(IpcError) as info:
            encode_frame(bad)  # type: ignore[arg-type]
        assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_encode_refuses_unencodable_values() -> None:
    for bad in ({"x": object()}, {"x": 2**70}, {"x": {1, 2}}):
        with pytest.raises(IpcError) as info:
            encode_frame(bad)
        assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_encode_refuses_oversized() -> None:
    with pytest.raises(FrameTooLarge) as info:
        encode_frame({"x": b"\0" * MAX_FRAME})
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    encode_frame({"x": b"\0" * (MAX_FRAME - 64)})  # just under the limit is fine


# -- async round trips ---------------------------------------------------------


def test_async_round_trip_many_frames() -> None:
    data = b"".join(encode_frame(s) for s in SAMPLES)
    assert run(read_all(data)) == SAMPLES


def test_async_round_trip_over_a_real_socket() -> None:
    async def main() -> list[dict[str, Any]]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        reader, writer = await asyncio.open_unix_connection(sock=a)
        b.setblocking(False)
        loop = asyncio.get_running_loop()

        async def send_all() -> None:
            for s in SAMPLES:
                await loop.sock_sendall(b, encode_frame(s))
            b.close()

        sender = asyncio.create_task(send_all())
        out = []
        while (frame := await read_frame(reader)) is not None:
            out.append(frame)
        await sender
        writer.close()
        return out

    assert run(main()) == SAMPLES


def test_clean_eof_is_none() -> None:
    assert read_one(b"") is None


# -- sync round trips --------------------------------------------------------


def test_sync_round_trip() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.settimeout(5)
        b.settimeout(5)
        for s in SAMPLES[:-1]:
            write_frame_sync(a, s)
            assert read_frame_sync(b) == s
        a.shutdown(socket.SHUT_WR)
        assert read_frame_sync(b) is None


def test_sync_large_frame_crosses_socket_buffers() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    big = {"blob": b"y" * (4 * 1024 * 1024)}
    with a, b:
        b.settimeout(5)
        a.settimeout(5)
        t = threading.Thread(target=write_frame_sync, args=(a, big))
        t.start()
        assert read_frame_sync(b) == big
        t.join(5)


# -- oversized prefixes ------------------------------------------------------


def test_async_oversize_prefix_refused_without_reading_or_allocating() -> None:
    huge = 100 * 1024 * 1024

    async def main() -> None:
        # Only the prefix is there and no EOF: a reader that tried to read the body would block.
        reader = reader_with(struct.pack(">I", huge), eof=False)
        tracemalloc.start()
        try:
            with pytest.raises(FrameTooLarge) as info:
                await read_frame(reader)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert info.value.code == ErrorCode.FRAME_TOO_LARGE
        assert info.value.size == huge
        assert peak < 1024 * 1024

    run(main())


def test_prefix_limit_is_configurable() -> None:
    data = encode_frame({"x": b"z" * 2000})
    with pytest.raises(FrameTooLarge):
        read_one(data, max_size=1000)
    assert read_one(data, max_size=4000) == {"x": b"z" * 2000}


def test_sync_oversize_prefix_refused_without_reading() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        a.sendall(struct.pack(">I", 0xFFFFFFFF))  # and nothing else: reading on would time out
        with pytest.raises(FrameTooLarge):
            read_frame_sync(b)


def test_frame_buffer_oversize_prefix_never_grows() -> None:
    fb = FrameBuffer(max_size=MAX_FRAME, initial=1024, decode=decode_body)
    view = fb.get_buffer()
    view[:4] = struct.pack(">I", 100 * 1024 * 1024)
    fb.buffer_updated(4)
    with pytest.raises(FrameTooLarge):
        fb.next_frame()
    assert len(fb.get_buffer()) <= 1024


# -- refused bodies ------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2, 3]),
        msgpack.packb("a string"),
        msgpack.packb(42),
        msgpack.packb(None),
        b"",  # zero-length body
        b"\xc1",  # never-used msgpack byte
        b"\x81\xa1a",  # truncated map
        msgpack.packb({"a": 1}) + b"\x00",  # trailing data
        msgpack.packb({1: "int key"}),  # strict_map_key
        b"\x91" * 5000 + b"\xc0",  # nested deeper than the unpacker's stack
        b"\x81\xa1k\xa2\xff\xfe",  # invalid utf-8 in a str
    ],
    ids=[
        "list",
        "str",
        "int",
        "nil",
        "empty",
        "bad-byte",
        "truncated-map",
        "trailing",
        "int-key",
        "too-deep",
        "bad-utf8",
    ],
)
def test_non_map_and_malformed_bodies_refused(body: bytes) -> None:
    with pytest.raises(InvalidFrame) as info:
        read_one(frame_of(body))
    assert info.value.code == ErrorCode.INVALID_FRAME


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb({"x": msgpack.ExtType(5, b"payload")}),
        b"\x81\xa1x\xd6\xff\x00\x00\x00\x01",  # fixext4 of type -1: a raw timestamp
        msgpack.packb({"x": msgpack.Timestamp(1_700_000_000, 5)}),
        b"\x81\xa1x\x91\xc7\x00\x01",  # an empty ext8 nested in a list
    ],
    ids=["ext5", "raw-timestamp", "timestamp", "nested-empty-ext"],
)
def test_ext_types_refused(body: bytes) -> None:
    with pytest.raises(InvalidFrame):
        decode_body(body)
    with pytest.raises(InvalidFrame):
        read_one(frame_of(body))


def test_invalid_frame_keeps_the_stream_in_sync() -> None:
    data = frame_of(msgpack.packb([1])) + encode_frame({"after": True})

    async def main() -> dict[str, Any] | None:
        reader = reader_with(data)
        with pytest.raises(InvalidFrame):
            await read_frame(reader)
        return await read_frame(reader)

    assert run(main()) == {"after": True}


# -- truncation ----------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 3, 4, 5, 20])
def test_async_truncated_frame_is_connection_closed(cut: int) -> None:
    data = encode_frame({"payload": "x" * 30})[:cut]
    with pytest.raises(ConnectionClosed) as info:
        read_one(data)
    assert info.value.code == ErrorCode.UNAVAILABLE
    assert isinstance(info.value, IpcError)


@pytest.mark.parametrize("cut", [2, 4, 10])
def test_sync_truncated_frame_is_connection_closed(cut: int) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(5)
        a.sendall(encode_frame({"payload": "x" * 30})[:cut])
        a.close()
        with pytest.raises(ConnectionClosed):
            read_frame_sync(b)


def test_sync_timeout_before_a_frame_is_timeout_error() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            read_frame_sync(b)


def test_sync_timeout_mid_frame_is_connection_closed() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.05)
        a.sendall(encode_frame({"payload": "x" * 30})[:10])
        with pytest.raises(ConnectionClosed) as info:
            read_frame_sync(b)
        assert isinstance(info.value.__cause__, TimeoutError)


# -- FrameBuffer -------------------------------------------------------------


def feed(fb: FrameBuffer, data: bytes) -> None:
    while data:
        view = fb.get_buffer()
        n = min(len(view), len(data))
        view[:n] = data[:n]
        fb.buffer_updated(n)
        data = data[n:]


def drain(fb: FrameBuffer) -> list[dict[str, Any]]:
    out = []
    while (frame := fb.next_frame()) is not None:
        out.append(frame)
    return out


def test_frame_buffer_byte_by_byte() -> None:
    samples = SAMPLES[:-1]
    data = b"".join(encode_frame(s) for s in samples)
    fb = FrameBuffer(initial=16, decode=decode_body)
    out: list[dict[str, Any]] = []
    for i in range(len(data)):
        feed(fb, data[i : i + 1])
        out.extend(drain(fb))
    assert out == samples
    assert fb.pending == 0


def test_frame_buffer_grows_for_a_big_frame_and_shrinks_back() -> None:
    fb = FrameBuffer(initial=1024, decode=decode_body)
    big = {"blob": b"q" * 500_000}
    data = encode_frame(big) + encode_frame({"small": 1})
    out: list[dict[str, Any]] = []
    for i in range(0, len(data), 7000):
        feed(fb, data[i : i + 7000])
        out.extend(drain(fb))
    assert out == [big, {"small": 1}]
    assert len(fb.get_buffer()) <= 1024


def test_frame_buffer_invalid_frame_keeps_sync_and_skip() -> None:
    fb = FrameBuffer(initial=64, decode=decode_body)
    feed(fb, frame_of(b"\xc1") + encode_frame({"a": 1}) + encode_frame({"b": 2}) + b"\x00\x00")
    with pytest.raises(InvalidFrame):
        fb.next_frame()
    assert fb.next_frame() == {"a": 1}
    assert fb.skip_frame() is True
    assert fb.skip_frame() is False  # a partial header remains
    assert fb.pending == 2


def test_frame_buffer_grows_with_what_arrived_not_with_the_declared_length() -> None:
    """Issue 10 item 7: a peer that declares an 8 MiB frame and sends 64 KiB costs about 2 x 64 KiB."""
    fb = FrameBuffer(initial=16 * 1024, decode=decode_body)
    feed(fb, struct.pack(">I", 8 * 1024 * 1024) + b"\x80" * (64 * 1024))
    assert fb.next_frame() is None
    assert fb.capacity <= 2 * (64 * 1024 + 4)
    assert fb.pending == 64 * 1024 + 4


def test_frame_buffer_never_grows_beyond_the_declared_frame() -> None:
    fb = FrameBuffer(initial=1024, decode=decode_body)
    frame = encode_frame({"blob": b"q" * 300_000})
    feed(fb, frame[:-1])
    assert fb.capacity == len(frame)  # doubling stopped at the frame's own size
    feed(fb, frame[-1:])
    assert fb.next_frame() == {"blob": b"q" * 300_000}


def test_frame_buffer_allocates_nothing_before_the_first_byte() -> None:
    fb = FrameBuffer(initial=1024, decode=decode_body)
    assert fb.capacity == 0  # a connection that never sends costs no buffer
    feed(fb, encode_frame({"a": 1}))
    assert drain(fb) == [{"a": 1}]
    assert fb.capacity == 1024  # kept for the next frame


def test_budget_refuses_growth_past_the_cap_but_not_initial_buffers() -> None:
    budget = BufferBudget(160 * 1024)
    big = [FrameBuffer(initial=16 * 1024, budget=budget, decode=decode_body) for _ in range(3)]
    for fb in big[:2]:
        feed(fb, struct.pack(">I", 1024 * 1024) + b"\x80" * 40_000)  # grows to 64 KiB each
    with pytest.raises(BufferLimitExceeded) as info:
        feed(big[2], struct.pack(">I", 1024 * 1024) + b"\x80" * 40_000)
    assert info.value.code == ErrorCode.BUFFERS_FULL and info.value.retryable
    small = FrameBuffer(initial=16 * 1024, budget=budget, decode=decode_body)
    feed(small, encode_frame({"still": "served"}))  # a small frame fits in its initial buffer
    assert drain(small) == [{"still": "served"}]
    used = budget.used
    for fb in big:
        fb.close()
    small.close()
    assert budget.used == 0 < used


@pytest.mark.parametrize("seq", [0, 1, 127, 128, 2**16, 2**40, 2**64 - 1])
@pytest.mark.parametrize("data", [None, {}, {"turn_id": "t:1", "update": {"text": "héllo", "n": [1, 2.5, True]}},
                                  {"blob": b"\x00" * 70_000}])
def test_an_event_frame_from_packed_data_is_the_frame_encode_frame_makes(seq: int, data: Any) -> None:
    kind = "session_update"
    assert event_frame(seq, kind, pack(data)) == encode_frame({"seq": seq, "kind": kind, "data": data})


@pytest.mark.parametrize("count", [1, 15, 16, 70_000])
def test_an_event_batch_frame_is_the_frame_encode_frame_makes_of_the_events(count: int) -> None:
    """Array headers of every size msgpack has (fixarray, array 16, array 32) included."""
    events = [(seq, "session_update", {"turn_id": "t", "n": seq}) for seq in range(count)]
    frames = event_batch_frames([(seq, kind, pack(data)) for seq, kind, data in events], 8 << 20)
    assert frames == [encode_frame({"events": [list(e) for e in events]})]


def test_event_batch_frames_hold_at_most_max_bytes_of_events_each_and_a_larger_event_alone() -> None:
    datas = [{"text": "x" * size} for size in (10, 10, 10, 500, 10, 10)]
    packed = [(seq, "k", pack(data)) for seq, data in enumerate(datas)]
    frames = event_batch_frames(packed, 100)
    decoded = [decode_body(frame[HEADER_SIZE:])["events"] for frame in frames]
    assert [[item[0] for item in frame] for frame in decoded] == [[0, 1, 2], [3], [4, 5]]
    assert [item[2] for frame in decoded for item in frame] == datas


def test_packed_size_is_the_body_size_encode_frame_writes_and_fails_as_msgpack_does() -> None:
    obj = {"seq": 7, "kind": "session_update", "data": {"text": "héllo" * 50, "b": b"\x00\x01", "n": -(2**40)}}
    assert packed_size(obj) == len(encode_frame(obj)) - 4
    with pytest.raises(TypeError):
        packed_size({"x": object()})
    assert packed_size({"x": 1}) == len(encode_frame({"x": 1})) - 4  # the failed pack left nothing behind
