"""The agent's way to its egress proxy, run inside its sandbox before the agent (standard library only).

An agent's network namespace has nothing but its own loopback, so its proxy variables
(``HTTPS_PROXY=http://127.0.0.1:3128`` ...) name a port there. This script, started by the sandbox
as ``python3 -I -S relay.py PORT SOCKET -- COMMAND...`` (``daemon.agentctl.sandbox.network``),
listens on ``127.0.0.1:PORT``, then forks the relay (detached from the agent: bwrap's init inherits
it) and executes COMMAND, the agent. The relay accepts each connection and hands the connected
socket itself, as a descriptor (``SCM_RIGHTS``), over the session's Unix socket ``SOCKET`` to the
control server's proxy, which then talks to the agent's client directly: no byte is copied in here.

It holds nothing and decides nothing: the proxy outside judges every request. An agent can kill it
(it runs as the agent's uid), which only takes its own way out. While the control server re-executes
(``kandev agentctl reload``) the socket is briefly absent or refuses: a hand-over is retried for
``RETRY_S``, so a request made then waits instead of failing. It ignores SIGTERM (a stop reaches the
agent first; the relay ends with the sandbox's pid namespace when the agent's process does).
"""

from __future__ import annotations

import array
import os
import signal
import socket
import sys
import time

RETRY_S = 5.0
CONNECT_TIMEOUT_S = 5.0


def hand_over(conn: socket.socket, path: str) -> None:
    """Send ``conn`` to the proxy at ``path`` (retrying while it is absent); drop it if it cannot be."""
    deadline = time.monotonic() + RETRY_S
    while True:
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        out.settimeout(CONNECT_TIMEOUT_S)
        try:
            out.connect(path)
            out.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [conn.fileno()]))])
            return
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)
        except OSError:
            return
        finally:
            out.close()


def serve(listener: socket.socket, path: str) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        except OSError:
            time.sleep(0.05)  # e.g. EMFILE: the agent's own limits; try again
            continue
        try:
            hand_over(conn, path)
        finally:
            conn.close()


def main(argv: list[str]) -> None:
    if len(argv) < 5 or argv[3] != "--":
        sys.stderr.write("usage: relay.py PORT SOCKET -- COMMAND...\n")
        os._exit(127)
    port, path, command = int(argv[1]), argv[2], argv[4:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    pid = os.fork()
    if pid == 0:
        try:
            if os.fork() != 0:
                os._exit(0)  # the relay is the grandchild: bwrap's init inherits it, the agent never sees it
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_IGN)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):  # never hold the agent's pipes open
                os.dup2(null, fd)
            os.close(null)
            serve(listener, path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    listener.close()
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
