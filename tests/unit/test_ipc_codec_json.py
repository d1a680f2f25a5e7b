"""The JSON codec of frame bodies (ipc/codec_json.py): what the kandev CLI speaks to the backend
(Issue 24 item 3). It carries what msgpack carries for the CLI's calls, refuses what is not one
strict JSON object, and never turns a value it cannot carry into something else."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack
import pytest

from ipc import codec_json, codec_msgpack
from ipc.errors import ErrorCode, IpcError
from ipc.framing import MAX_FRAME, FrameBuffer, FrameTooLarge, InvalidFrame

VALUES: list[Any] = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.25, 1e300, "", "héllo ✓ \u2028 \x00",
                     "\ud7ff", [1, [2, [3]]], {"k": {"n": [None]}}, {"": ""}]


@pytest.mark.parametrize("value", VALUES)
def test_a_value_comes_back_as_msgpack_brings_it(value: Any) -> None:
    obj = {"v": 1, "id": 7, "op": "echo", "args": {"value": value}}
    frame = codec_json.encode_frame(obj)
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4
    assert codec_json.decode_body(frame[4:]) == obj
    assert codec_json.decode_body(memoryview(frame)[4:]) == codec_msgpack.decode_body(codec_msgpack.encode_frame(obj)[4:])


def test_the_body_is_compact_utf8_json_that_any_parser_reads() -> None:
    body = codec_json.encode_frame({"a": [1, "é"], "b": None})[4:]
    assert body == '{"a":[1,"é"],"b":null}'.encode()
    assert json.loads(body) == {"a": [1, "é"], "b": None}


@pytest.mark.parametrize("value", [b"\x00", bytearray(b"x"), float("nan"), float("inf"), object(), "\ud800"])
def test_a_value_json_cannot_carry_is_an_encoding_error(value: Any) -> None:
    with pytest.raises(IpcError) as info:
        codec_json.encode_frame({"x": [value]})
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert codec_json.encode_frame({"x": 1})  # the encoder is still usable


def test_a_cycle_and_a_non_map_are_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    for bad in ({"x": loop}, [1], "x"):
        with pytest.raises(IpcError) as info:
            codec_json.encode_frame(bad)  # type: ignore[arg-type]
        assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_a_body_over_the_frame_limit_is_refused() -> None:
    with pytest.raises(FrameTooLarge):
        codec_json.encode_frame({"x": "a" * MAX_FRAME})


@pytest.mark.parametrize("body, why", [
    (b"", "not a JSON object"),
    (b"[1]", "not a JSON object"),
    (b'"x"', "not a JSON object"),
    (b" {}", "not a JSON object"),  # a body starts with its object: the byte that tells the codec
    (b"{", "Expecting property name"),
    (b'{"a":1} {}', "more than one JSON value"),
    (b'{"a":1}x', "more than one JSON value"),
    (b'{"a":NaN}', "NaN is not a number JSON allows"),
    (b'{"a":-Infinity}', "-Infinity is not a number JSON allows"),
    (b'{"a":"\x01"}', "Invalid control character"),
    (b'{"a":"\xff"}', "can't decode byte 0xff"),
    (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"a":' + b"9" * 5000 + b"}", "integer string conversion"),
])
def test_a_body_that_is_not_one_strict_json_object_is_an_invalid_frame(body: bytes, why: str) -> None:
    with pytest.raises(InvalidFrame) as info:
        codec_json.decode_body(body)
    assert why in info.value.message


def test_whitespace_after_the_object_is_json() -> None:
    assert codec_json.decode_body(b'{"a":1}\n') == {"a": 1}


def test_a_frame_buffer_splits_json_frames_with_the_codec_it_is_given() -> None:
    frames = FrameBuffer(initial=64, decode=codec_json.decode_body)
    data = b"".join(codec_json.encode_frame({"n": i, "pad": "x" * i}) for i in range(50))
    got = []
    at = 0
    while at < len(data):  # in reads of at most 7 bytes, taking the frames as they complete
        room = frames.get_buffer()
        n = min(len(room), 7, len(data) - at)
        room[:n] = data[at:at + n]
        frames.buffer_updated(n)
        at += n
        while (frame := frames.next_frame()) is not None:
            got.append(frame["n"])
    assert got == list(range(50))


def test_a_client_reads_a_msgpack_frame_the_server_wrote_before_it_read_ours() -> None:
    refusal = {"id": None, "ok": False, "error": {"code": "permission_denied", "message": "m", "retryable": False}}
    assert codec_json.decode_reply_body(codec_msgpack.encode_frame(refusal)[4:]) == refusal
    assert codec_json.decode_reply_body(codec_json.encode_frame(refusal)[4:]) == refusal
    with pytest.raises(InvalidFrame):
        codec_json.decode_reply_body(msgpack.packb([1]))
    with pytest.raises(InvalidFrame):
        codec_json.decode_body(codec_msgpack.encode_frame(refusal)[4:])  # a server never reads msgpack as JSON


def test_a_msgpack_map_never_starts_with_the_byte_of_a_json_object() -> None:
    """The server tells the codecs apart by a body's first byte: ``{`` is 0x7b, a positive fixint in
    msgpack, never the first byte of a map (0x80-0x8f, 0xde, 0xdf)."""
    for n in (0, 1, 15, 16, 70_000):
        body = codec_msgpack.encode_frame({f"k{i}": i for i in range(n)})[4:]
        assert body[0] != codec_json.FIRST_BYTE
