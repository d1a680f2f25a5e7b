"""The msgpack codec of frame bodies: what every kandev peer speaks.

``encode_frame`` turns a map into a whole frame (the length prefix of ``ipc.framing`` included);
``decode_body`` turns a body back into a map, defensively: ``raw=False``, ``strict_map_key=True``,
bounded lengths and no ext types (the built-in timestamp included), and anything that is not a map
is refused with ``InvalidFrame``. ``ipc.codec_json`` is the other codec, with the same three names.
"""

from __future__ import annotations

from _thread import _local as thread_local  # threading.local, without importing threading

import msgpack

from .errors import ErrorCode, IpcError
from .framing import HEADER, MAX_FRAME, FrameTooLarge, InvalidFrame

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

NAME = "msgpack"


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
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(len(body), MAX_FRAME)
    return HEADER.pack(len(body)) + body


def packed_size(obj: Any) -> int:
    """How many bytes msgpack encodes ``obj`` into, as ``encode_frame`` packs it (this thread's
    packer, not a new one per call); raises what msgpack raises for a value it cannot encode."""
    return len(_packer().pack(obj))


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


