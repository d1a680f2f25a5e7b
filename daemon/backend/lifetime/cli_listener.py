"""The backend's CLI socket across its start: bound once, handed from server to server.

While the store is out of space the backend serves ``status`` on its CLI socket
(``daemon.backend.lifetime.space_wait``); once the store opens, the normal server takes over. Each
hand-over passes the listening socket itself, still open, from the server that stops to the one
that starts: the socket file never disappears while the backend runs, and a client that connects
in between waits in the socket's backlog instead of being told there is no backend. A connection
the stopping server had already accepted is closed with it; a CLI call whose request it closed
before the request was written asks the next server (``daemon.cli.call.call``).
"""

from __future__ import annotations

import socket

from ipc.listener import SocketIdentity, unlink_if_ours
from ipc.server import IpcServer


class CliListener:
    """Holds the CLI socket's listener between two servers (none held at first: the first binds)."""

    def __init__(self) -> None:
        self._held: tuple[socket.socket, SocketIdentity | None, str] | None = None  # listener, its file, path

    @property
    def held(self) -> bool:
        return self._held is not None

    async def serve(self, server: IpcServer) -> None:
        """Start ``server`` on the held listener, or bind its socket when none is held."""
        if self._held is None:
            await server.start()
            return
        sock, identity, _ = self._held
        self._held = None
        try:
            await server.start_on(sock, identity)
        except BaseException:
            sock.close()
            unlink_if_ours(server.path, identity)
            raise

    async def hand_over(self, server: IpcServer) -> None:
        """Stop ``server`` and keep its listener (and socket file) for the next server."""
        identity = server.identity
        self._held = (server.stop_accepting(), identity, server.path)
        await server.close(keep_socket_file=True)

    def release(self) -> None:
        """The backend stops with no next server: close a held listener and remove its file."""
        if self._held is not None:
            sock, identity, path = self._held
            self._held = None
            sock.close()
            unlink_if_ours(path, identity)
