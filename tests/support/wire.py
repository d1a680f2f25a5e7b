"""Reading kandev's frames off a raw socket in tests: a 4-byte big-endian length, then the body.

Tests that speak to a server below ``ipc``'s clients (refusals, scripted servers, bytes a client
would never send) read its answers with ``read_frame_body``; each decodes the body in the codec
it expects.
"""

from __future__ import annotations

import socket

from ipc.framing import HEADER


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame_body(sock: socket.socket) -> bytes | None:
    """The next frame's body, read exactly (the next frame stays queued); None if the peer closed
    the connection first."""
    header = _exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    return _exactly(sock, size)
