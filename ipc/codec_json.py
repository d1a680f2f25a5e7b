"""The JSON codec of frame bodies: one JSON object (UTF-8) in a length-prefixed frame.

A server that accepts it (``IpcServer(accept_json=True)``: the backend's) tells the codec of a
connection by its first frame's body: ``{`` is JSON (a msgpack request, a map, never starts with
that byte), anything else msgpack; it answers in the same codec for the rest of the connection.
The kandev CLI speaks it because loading msgpack costs a third of the interpreter's own start on
every call, while the JSON accelerator the standard library ships (``_json``, the C half of
``json``) loads in a fraction of that and imports nothing else.

The values are what both codecs carry: maps with string keys, lists, strings, integers, floats,
booleans and null. Stricter than ``json`` by default: a non-finite float is refused on either side,
and a value JSON cannot carry (bytes) is an encoding error, never its ``str()``; a map key that is
not a string is written as JSON writes it (``1`` as ``"1"``), as the CLI printed it anyway. Before
a server has read a frame it can only answer in msgpack (a refused peer is told why before it sent
anything), so a client reads such a frame with ``decode_reply_body``.
"""

from __future__ import annotations

from .errors import ErrorCode, IpcError
from .framing import InvalidFrame, frame_of

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

FIRST_BYTE = ord("{")
"""The first byte of every JSON body (a map); a msgpack map never starts with it."""
_TRAILING = " \t\n\r"  # whitespace JSON allows after the value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _not_json(value: Any) -> Any:
    raise TypeError(f"a {type(value).__name__} cannot be carried in JSON")


class _DecodeSettings:
    """What the JSON scanner reads from its context (``json.JSONDecoder``'s attributes)."""

    strict = True  # no raw control characters inside strings
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_refuse_constant)
    memo: dict[str, str] = {}  # the pure-Python scanner's key cache (it clears it after each scan)


def _codec() -> tuple[Callable[[str, int], tuple[Any, int]], Callable[[Any], str]]:
    """The scanner and the compact encoder: the C accelerator's, else json's own."""
    try:
        from _json import encode_basestring, make_encoder, make_scanner
    except ImportError:  # an interpreter without it: the json package (which imports re)
        import json.scanner

        encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_not_json)
        return json.scanner.make_scanner(_DecodeSettings), encoder.encode  # type: ignore[arg-type]
    # JSONEncoder's own call of the accelerator: no circular check (a cycle is a RecursionError),
    # our default, non-ASCII kept (UTF-8 on the wire), compact separators, unsorted, strict floats
    encode = make_encoder(None, _not_json, encode_basestring, None, ":", ",", False, False, False)
    return make_scanner(_DecodeSettings), lambda obj: "".join(encode(obj, 0))  # type: ignore[arg-type]


_scan, _encode = _codec()


def encode_frame(obj: dict[str, Any]) -> bytes:
    """Encode one map as a complete frame (length prefix included); the errors of
    ``ipc.codec_msgpack.encode_frame``."""
    if not isinstance(obj, dict):
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"a frame must be a map, not {type(obj).__name__}")
    try:
        body = _encode(obj).encode("utf-8")
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"value cannot be encoded: {exc}") from None
    return frame_of(body)


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a frame body (without its prefix) into a map, or raise ``InvalidFrame``."""
    if not body or body[0] != FIRST_BYTE:
        raise InvalidFrame("frame body is not a JSON object")
    try:
        text = str(body, "utf-8")
        obj: dict[str, Any]  # an object: the scan starts at the "{"
        obj, end = _scan(text, 0)
    except Exception:  # UnicodeDecodeError, JSONDecodeError, StopIteration, RecursionError, ...
        raise InvalidFrame(f"frame body is not valid JSON: {_why_not_json(body)}") from None
    if text[end:].strip(_TRAILING):
        raise InvalidFrame(f"frame body holds more than one JSON value (extra data at {end})")
    return obj


def _why_not_json(body: bytes | memoryview) -> str:
    """What json says of a body the scanner refused (the accelerator raises its readable error only
    once the json package is loaded: an error path may load it)."""
    import json

    try:
        json.loads(bytes(body), parse_constant=_refuse_constant)
    except RecursionError:
        return "nested too deeply"
    except Exception as exc:
        return str(exc)
    return "refused by the scanner"


def decode_reply_body(body: bytes | memoryview) -> dict[str, Any]:
    """A client's decoder: JSON, or msgpack for a frame the server wrote before it read ours (a
    refusal at connect)."""
    if body and body[0] == FIRST_BYTE:
        return decode_body(body)
    from .codec_msgpack import decode_body as decode_msgpack

    return decode_msgpack(body)
