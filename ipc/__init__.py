"""kandev's IPC protocol library: length-prefixed msgpack (or JSON, for clients) over Unix sockets.

A protocol is an ``OpTable`` (``ipc.schema``) shared by an ``IpcServer``
(``ipc.server``) and its clients (``ipc.client``: ``AsyncClient``,
``SyncClient``). Frames are defined in ``ipc.framing``, their bodies in ``ipc.codec_msgpack`` and
``ipc.codec_json``, peer admission in
``ipc.peercred``, typed errors in ``ipc.errors``. This package knows nothing
about agents, sessions or ownership: it moves typed requests, responses and
event streams between processes of the same user.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module

# Each name and the module that defines it, imported on first use: a blocking client (the kandev
# CLI) needs ipc.sync_client, never the asyncio server and clients (tests/unit/test_cli_imports.py).
_EXPORTS = {
    "AsyncClient": "client", "Event": "client", "EventStream": "client",
    "ConnectionContext": "connection",
    "ErrorCode": "errors", "IpcError": "errors",
    "MAX_FRAME": "framing", "ConnectionClosed": "framing", "FrameTooLarge": "framing", "InvalidFrame": "framing",
    "encode_frame": "codec_msgpack", "read_frame": "codec_msgpack", "read_frame_sync": "codec_msgpack",
    "write_frame_sync": "codec_msgpack",
    "HELLO": "hello",
    "SocketInUseError": "listener",
    "PeerCredentials": "peercred", "peer_admitted": "peercred", "peer_credentials": "peercred",
    "Op": "schema", "OpTable": "schema",
    "Authorize": "server", "Handler": "server", "IpcServer": "server",
    "SyncClient": "sync_client",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module  # here: the package itself is imported by every CLI call

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from typing import Any

    from .client import AsyncClient, Event, EventStream
    from .codec_msgpack import encode_frame, read_frame, read_frame_sync, write_frame_sync
    from .connection import ConnectionContext
    from .errors import ErrorCode, IpcError
    from .framing import (
        MAX_FRAME,
        ConnectionClosed,
        FrameTooLarge,
        InvalidFrame,
    )
    from .hello import HELLO
    from .listener import SocketInUseError
    from .peercred import PeerCredentials, peer_admitted, peer_credentials
    from .schema import Op, OpTable
    from .server import Authorize, Handler, IpcServer
    from .sync_client import SyncClient

__all__ = [
    "HELLO",
    "MAX_FRAME",
    "AsyncClient",
    "Authorize",
    "ConnectionClosed",
    "ConnectionContext",
    "ErrorCode",
    "Event",
    "EventStream",
    "FrameTooLarge",
    "Handler",
    "InvalidFrame",
    "IpcError",
    "IpcServer",
    "Op",
    "OpTable",
    "PeerCredentials",
    "SocketInUseError",
    "SyncClient",
    "encode_frame",
    "peer_admitted",
    "peer_credentials",
    "read_frame",
    "read_frame_sync",
    "write_frame_sync",
]
