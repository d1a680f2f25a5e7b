"""kandev's IPC protocol library: length-prefixed msgpack over Unix sockets.

A protocol is an ``OpTable`` (``ipc.schema``) shared by an ``IpcServer``
(``ipc.server``) and its clients (``ipc.client``: ``AsyncClient``,
``SyncClient``). Frames are defined in ``ipc.framing``, peer admission in
``ipc.peercred``, typed errors in ``ipc.errors``. This package knows nothing
about agents, sessions or ownership: it moves typed requests, responses and
event streams between processes of the same user.
"""

from .client import AsyncClient, Event, EventStream
from .connection import ConnectionContext
from .errors import ErrorCode, IpcError
from .framing import (
    MAX_FRAME,
    ConnectionClosed,
    FrameTooLarge,
    InvalidFrame,
    encode_frame,
    read_frame,
    read_frame_sync,
    write_frame_sync,
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
