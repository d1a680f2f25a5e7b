"""kandev's git transport inside an agent's sandbox (Issue 20): a byte pipe to the session's git endpoint.

kandev configures the agent's git (``daemon.credentials.agent_env``) to rewrite its GitHub URLs
to ``ext::`` commands (git-remote-ext(1)) that run this module::

    python -I -m daemon.git_transport PROXY_SOCKET CREDENTIAL_SOCKET LEASE_FILE HOST SERVICE PATH

git then speaks its own protocol (pkt-lines, as over ssh) on our stdin and stdout. We check the
session's lease with its credential endpoint (``daemon.git_credential_helper.valid_lease``: one
reissue after an expired or revoked lease), connect to the session's git endpoint
(``daemon.backend.git.endpoint``, outside the sandbox), send one JSON header line (service, host,
path, lease token) and then copy bytes both ways until the endpoint closes. Everything is
decided by the endpoint: this process holds no upstream credential and enforces nothing.

While the backend restarts the sockets are briefly absent: connecting is retried for up to
``CONNECT_WAIT_S``, so a push started then completes once the backend is back, or fails with a
message saying so; it never hangs. Failures are printed to stderr as ``fatal: kandev: ...`` and
the exit code is 128, as git's own transports do.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import time

from daemon.git_credential_helper import HelperError, valid_lease
from ipc.errors import ErrorCode

CONNECT_WAIT_S = 30.0
RETRY_EVERY_S = 0.5
IDLE_TIMEOUT_S = 300.0
CHUNK = 64 * 1024
USAGE = "usage: python -m daemon.git_transport PROXY_SOCKET CREDENTIAL_SOCKET LEASE_FILE HOST SERVICE PATH"


class TransportError(Exception):
    pass


def _lease(credential_socket: str, lease_file: str, host: str, path: str, deadline: float) -> str:
    while True:
        try:
            return valid_lease(lease_file, credential_socket, host, path)
        except HelperError as exc:
            if exc.code != ErrorCode.UNAVAILABLE or time.monotonic() >= deadline:
                hint = " (is the kandev backend running?)" if exc.code == ErrorCode.UNAVAILABLE else ""
                raise TransportError(f"{exc.code}: {exc.message}{hint}") from None
        time.sleep(RETRY_EVERY_S)


def _connect(path: str, deadline: float) -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise TransportError(f"the session's git endpoint is not answering ({exc.strerror});"
                                     " the kandev backend may be stopped or restarting") from None
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot reach the session's git endpoint: {exc.strerror or exc}") from None
        time.sleep(RETRY_EVERY_S)


def _pipe(sock: socket.socket, stdin: int, stdout: int) -> None:
    """Copy stdin -> socket (half-closing it at end of input) and socket -> stdout until the
    endpoint closes; ``IDLE_TIMEOUT_S`` without a byte either way ends it."""
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(stdin, selectors.EVENT_READ, "stdin")
    while True:
        events = sel.select(IDLE_TIMEOUT_S)
        if not events:
            raise TransportError("the git endpoint did not answer in time")
        for key, _ in events:
            if key.data == "sock":
                try:
                    data = sock.recv(CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    return
                _write_all(stdout, data)
            else:
                data = os.read(stdin, CHUNK)
                if not data:
                    sel.unregister(stdin)
                    sock.shutdown(socket.SHUT_WR)
                    continue
                sock.setblocking(True)
                sock.settimeout(IDLE_TIMEOUT_S)
                sock.sendall(data)
                sock.setblocking(False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 6:
        print(USAGE, file=sys.stderr)
        return 129
    proxy_socket, credential_socket, lease_file, host, service, path = args
    deadline = time.monotonic() + CONNECT_WAIT_S
    try:
        token = _lease(credential_socket, lease_file, host, path, deadline)
        sock = _connect(proxy_socket, deadline)
        header = {"v": 1, "service": service, "host": host, "path": path, "lease_token": token}
        sock.settimeout(IDLE_TIMEOUT_S)
        sock.sendall(json.dumps(header).encode() + b"\n")
        try:
            _pipe(sock, sys.stdin.fileno(), sys.stdout.fileno())
        finally:
            sock.close()
    except TransportError as exc:
        print(f"fatal: kandev: {exc}", file=sys.stderr)
        return 128
    except OSError as exc:
        print(f"fatal: kandev: the connection to the git endpoint failed: {exc.strerror or type(exc).__name__}",
              file=sys.stderr)
        return 128
    return 0


if __name__ == "__main__":
    sys.exit(main())
