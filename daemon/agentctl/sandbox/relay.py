"""The agent's way to its egress proxy, run inside its sandbox before the agent (standard library only).

An agent's network namespace has nothing but its own loopback, so its proxy variables
(``HTTPS_PROXY=http://127.0.0.1:3128`` ...) name a port there. This script, started by the sandbox
as ``python3 -I -S relay.py PORT SOCKET -- COMMAND...`` (``daemon.agentctl.sandbox.network``),
listens on ``127.0.0.1:PORT``, then forks the relay (detached from the agent: bwrap's init inherits
it) and executes COMMAND, the agent. The relay accepts each connection and hands the connected
socket itself, as a descriptor (``SCM_RIGHTS``), over the session's Unix socket ``SOCKET`` to the
control server's proxy, which then talks to the agent's client directly: no byte is copied in here.
One thing only code inside the namespace can do: connect to the namespace's own loopback (a server
the agent itself runs, such as OpenCode's own on 127.0.0.1:4096, which a client honouring the proxy
variables asks the proxy for). For a loopback destination ``[network] host_ports`` does not list,
the proxy asks the relay for such a connection (``own_loopback``) and gets it as a descriptor too.

It holds nothing and decides nothing: the proxy outside judges every request. An agent can kill it
(it runs as the agent's uid), which only takes its own way out. While the control server re-executes
(``kandev agentctl reload``) the socket is briefly absent or refuses: a hand-over is retried for
``RETRY_S``, so a request made then waits instead of failing. It ignores SIGTERM (a stop reaches the
agent first; the relay ends with the sandbox's pid namespace when the agent's process does).
"""

from __future__ import annotations

import array
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
import time

RETRY_S = 5.0
CONNECT_TIMEOUT_S = 5.0
REPLY_TIMEOUT_S = 90.0  # the proxy asks (or closes) once it has read and judged the request


def _send_fd(out: socket.socket, fd: int) -> None:
    out.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _connected(path: str) -> socket.socket | None:
    """A connection to the proxy at ``path``, retried while it is absent (a reload)."""
    deadline = time.monotonic() + RETRY_S
    while True:
        out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        out.settimeout(CONNECT_TIMEOUT_S)
        try:
            out.connect(path)
            return out
        except (FileNotFoundError, ConnectionRefusedError):
            out.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        except OSError:
            out.close()
            return None


def own_loopback(out: socket.socket) -> None:
    """The proxy's one possible question once it has read the request: ``L <address> <port>``, a
    connection to this namespace's own loopback (a server the agent runs itself), which only code
    inside the namespace can open. Answered with the connected socket, or ``E`` when nothing listens
    there; any other address is refused."""
    out.settimeout(REPLY_TIMEOUT_S)
    for _ in range(4):  # localhost: 127.0.0.1, then ::1
        try:
            ask = out.recv(128).split()
        except OSError:
            return
        if len(ask) != 3 or ask[0] != b"L":
            return
        try:
            ip, port = ipaddress.ip_address(ask[1].decode("ascii")), int(ask[2])
            if not ip.is_loopback:
                raise ValueError(f"{ip} is not a loopback address")
            local = socket.create_connection((str(ip), port), timeout=CONNECT_TIMEOUT_S)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                out.sendall(b"E\n")
            continue
        try:
            _send_fd(out, local.fileno())
        except OSError:
            pass
        finally:
            local.close()
        return


def hand_over(conn: socket.socket, path: str) -> None:
    """Send ``conn`` to the proxy at ``path``, then answer its question, if any; drop ``conn`` if
    the proxy cannot be reached."""
    try:
        out = _connected(path)
        if out is None:
            return
        try:
            _send_fd(out, conn.fileno())
            conn.close()
            own_loopback(out)
        except OSError:
            pass
        finally:
            out.close()
    finally:
        conn.close()


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
            threading.Thread(target=hand_over, args=(conn, path), daemon=True).start()
        except RuntimeError:  # no thread to be had (the agent's process cap): this connection only
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
