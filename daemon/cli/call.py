"""One operation on the backend's socket, on a connection of its own (``call``), and the exit
status a ``kandev`` call ends with: what every command that talks to the backend needs, and nothing
more (the quick path of the CLI imports it; tests/unit/test_cli_imports.py keeps it lean).

The call speaks JSON (``ipc.codec_json``), which the backend's socket accepts beside msgpack:
loading msgpack would cost every call a third of the interpreter's start.
"""

from __future__ import annotations

from daemon.api.version import VERSION as API_VERSION
from ipc.errors import ErrorCode, IpcError, RequestNotSent
from ipc.sync_client import SyncClient

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


def call(socket: str | Path, op: str, args: dict[str, Any] | None = None, timeout: float | None = 60.0) -> Any:
    """One operation on the backend's socket, on a connection of its own.

    Asked once more on a new connection when the first was closed before the request could be
    written (``RequestNotSent``: the backend ran nothing). That is what a client connecting in the
    moment a backend hands its socket from the server that waited for disk space to the normal one
    sees, or the moment a backend stops; a request that was written is never asked twice."""
    try:
        with connect(socket) as client:
            return client.call(op, args or {}, timeout=timeout)
    except RequestNotSent:
        pass
    with connect(socket) as client:
        return client.call(op, args or {}, timeout=timeout)


def connect(socket: str | Path) -> SyncClient:
    """A connection to the backend's socket, in JSON; in msgpack to a backend that refused the JSON
    hello as an invalid frame (releases before 0.3.0 accept only msgpack: an upgraded CLI must
    still stop the backend it replaces). The hello changes nothing, so asking twice is safe."""
    try:
        return SyncClient(str(socket), protocol_major=API_VERSION[0], timeout=5.0, json=True)
    except IpcError as exc:
        if exc.code != ErrorCode.INVALID_FRAME:
            raise
    return SyncClient(str(socket), protocol_major=API_VERSION[0], timeout=5.0)


def exit_status(exc: IpcError) -> int:
    """3 when the backend could not be reached, 1 when it refused."""
    return EXIT_UNREACHABLE if exc.code == ErrorCode.UNAVAILABLE else EXIT_REFUSED
