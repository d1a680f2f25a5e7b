"""Each agent's egress proxy endpoint: a Unix socket per instance, the connections it hands over,
and the refusals it counts.

``EgressHost`` (one per control server) makes, for every sandboxed agent whose network mode is not
``"none"``, a directory ``<run>/egress/<instance id>/`` (0711, the server's) with a listening socket
``proxy.sock`` (0600, given to the agent's uid). The directory is bound into that agent's sandbox
(read-only), so only that agent reaches the socket; the relay in the sandbox
(``daemon.agentctl.sandbox.relay``) connects to it and passes each connection the agent made to
its proxy port as a descriptor. ``SessionEgress`` receives them and runs
``daemon.agentctl.egress.proxy.serve`` on each, under the instance's ``NetworkPolicy``.

A refusal is counted on the instance (``stats``: the count and the last ``RECENT`` destinations,
what ``list_instances`` and so ``session show`` and ``status`` report) and written to the journal
as ``network_refused`` (session, agent, host, port, reason).

The proxy belongs to the control server, not the backend: it serves through a backend restart. A
re-exec (``kandev agentctl reload``) carries each instance's policy and socket path in its spec
(``InstanceSpec.network``); the new image binds a fresh socket at the same path in the same
directory (the sandbox binds the directory, so the agent sees the new one), and the relay retries
meanwhile; tunnels open at the exec end with the old image. A server that dies takes its agents
with it (their parent-death signal), so nothing outlives it; a directory left by one is removed
when an instance of the same id... never comes again, and ``prune`` removes those that no socket
answers at start.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from daemon.agentctl.egress import proxy
from daemon.agents.network import NetworkPolicy, Refusal
from daemon.core import faults
from daemon.core.journal import log_event
from ipc.aio import within

log = logging.getLogger("kandev.agentctl.egress")

SOCKET_NAME = "proxy.sock"
RECENT = 5
MAX_CONNECTIONS = 256  # per instance, at once
_FDS_PER_MESSAGE = 1


@dataclass
class RefusedDestination:
    host: str
    port: int
    reason: str
    at: float

    def to_wire(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "reason": self.reason, "at": self.at}


async def test_resolve(host: str, port: int) -> list[proxy.Address]:
    """The resolver under the ``egress_test_resolver`` fault: names ending in ``.test`` (a name
    reserved for testing, RFC 6761) are 127.0.0.1; the rest as the system says."""
    if host.lower().rstrip(".").endswith(".test"):
        return [ipaddress.IPv4Address("127.0.0.1")]
    return await proxy.system_resolve(host, port)


class SessionEgress:
    """One instance's proxy endpoint (see the module docstring)."""

    def __init__(self, instance_id: str, session_id: str, agent: str, policy: NetworkPolicy, path: str, *,
                 subject: str | None = None, fields: dict[str, Any] | None = None) -> None:
        """``subject``: who the refusals are told of (default ``session ID (AGENT)``); ``fields``: more
        journal fields of each ``network_refused`` (runtime preparation's job, say)."""
        self.instance_id = instance_id
        self.session_id = session_id
        self.agent = agent
        self.policy = policy
        self.path = path
        self.refused_count = 0
        self.recent: deque[RefusedDestination] = deque(maxlen=RECENT)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.note: Callable[[str], None] | None = None  # a line among the agent's stderr (``kandev logs``)
        self.subject = subject or f"session {session_id} ({agent or 'agent'})"
        self.fields = dict(fields or {})

    # -- what the proxy reports ---------------------------------------------------------

    def refused(self, host: str, port: int, refusal: Refusal) -> None:
        self.refused_count += 1
        self.recent.append(RefusedDestination(host, port, refusal.reason, time.time()))
        log_event(
            "network_refused",
            f"{self.subject}: refused {host}:{port}: {refusal.message}",
            priority=5,
            SESSION_ID=self.session_id,
            INSTANCE_ID=self.instance_id,
            AGENT=self.agent,
            HOST=host,
            PORT=port,
            REASON=refusal.reason,
            **self.fields,
        )
        if self.note is not None:
            self.note(f"kandev: {proxy.refusal_body(host, port, refusal).removeprefix('kandev: ')}")

    def stats(self) -> dict[str, Any]:
        return {"mode": self.policy.mode, "refused": self.refused_count,
                "recent_refused": [r.to_wire() for r in self.recent]}

    def restore_stats(self, doc: Any) -> None:
        if not isinstance(doc, dict):
            return
        count = doc.get("refused")
        if isinstance(count, int):
            self.refused_count = count
        for r in doc.get("recent_refused") or []:
            with contextlib.suppress(Exception):
                self.recent.append(RefusedDestination(str(r["host"]), int(r["port"]), str(r["reason"]), float(r["at"])))

    # -- the socket ---------------------------------------------------------------------

    def bind(self, agent_uid: int | None, agent_gid: int | None) -> None:
        """Make the directory and the listening socket (blocking, quick); a stale socket file of a
        previous process image at the same path is replaced."""
        directory = os.path.dirname(self.path)
        os.makedirs(os.path.dirname(directory), mode=0o711, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o711)
        os.chmod(directory, 0o711 if agent_uid not in (None, os.geteuid()) else 0o700)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
            if agent_uid is not None and agent_uid != os.geteuid():
                os.chown(self.path, agent_uid, agent_gid if agent_gid is not None else -1)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock

    def start(self) -> None:
        if self._listener is not None and self._accepting is None:
            self._accepting = asyncio.ensure_future(self._accept_loop(self._listener))

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        resolve = test_resolve if faults.active("egress_test_resolver") else proxy.system_resolve
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                log.warning("egress %s: accept failed: %s", self.instance_id, exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.ensure_future(self._one(conn, resolve))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _one(self, conn: socket.socket, resolve: proxy.Resolve) -> None:
        """Receive the agent's socket from the relay's connection, then proxy it; the relay's
        connection stays open until the request is judged, for a connection to the agent's own
        loopback (``proxy.OwnLoopback``)."""
        loop = asyncio.get_running_loop()

        async def own(ip: proxy.Address, port: int) -> socket.socket | None:
            try:
                await loop.sock_sendall(conn, f"L {ip} {port}\n".encode("ascii"))
                return await within(_receive_socket(conn), proxy.CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError, ValueError):
                return None

        try:
            agent_sock = await within(_receive_socket(conn), 10.0)
            if agent_sock is None:
                return
            if len(self._connections) > MAX_CONNECTIONS:
                agent_sock.close()
                return
            await proxy.serve(agent_sock, self, resolve, own, conn.close)
        except (OSError, TimeoutError, ValueError):
            return
        finally:
            conn.close()

    async def close(self, *, remove: bool = True) -> None:
        """Stop accepting and end this instance's connections; ``remove``: its directory too."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(BaseException):
                await self._accepting
            self._accepting = None
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if remove:
            shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


async def _receive_socket(conn: socket.socket) -> socket.socket | None:
    """The one descriptor the relay sends on ``conn`` (close-on-exec), as a socket."""
    loop = asyncio.get_running_loop()
    conn.setblocking(False)
    while True:
        try:
            _, ancdata, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(_FDS_PER_MESSAGE * 4), socket.MSG_CMSG_CLOEXEC)
            break
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_reader(conn.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(conn.fileno())
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            ints = array.array("i")
            ints.frombytes(data[: len(data) - len(data) % ints.itemsize])
            fds.extend(ints)
    for extra in fds[1:]:
        os.close(extra)
    if not fds:
        return None
    try:
        sock = socket.socket(fileno=fds[0])
    except OSError:
        os.close(fds[0])
        return None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.close()
        return None
    sock.setblocking(False)
    return sock
