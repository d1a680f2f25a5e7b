"""One connection through an agent's egress proxy: read the request, judge it, connect, copy.

``serve`` gets the agent's connected socket (handed over by the relay in its sandbox,
``daemon.agentctl.egress.listener``) and:

1. reads the request head (``daemon.agentctl.egress.request``; at most ``MAX_HEAD`` bytes within
   ``HEAD_TIMEOUT_S``);
2. asks the policy whether the agent may name this destination (``NetworkPolicy.check_name``);
3. resolves the name (``resolve``) and keeps the addresses the policy admits
   (``NetworkPolicy.check_address``: no private address unless listed in ``host_ports``), then
   connects to one of those, and only those, by address: the name is never resolved again, so
   what was judged is what is reached;
4. answers ``200 Connection established`` to a CONNECT, or sends the rewritten head of a plain
   HTTP request, and copies bytes both ways until both sides are done
   (``daemon.agentctl.egress.tunnel``: kernel to kernel with ``splice``).

It works on the raw non-blocking sockets with the event loop's ``sock_*`` calls: no transport
or stream buffer per connection, so setting a connection up costs little and the copy can be
the kernel's.

A loopback destination (``127.0.0.1:PORT``, ``localhost``) that ``host_ports`` does not list is
the agent's own loopback, not the host's: a client that honours the proxy variables for every
host (``NO_PROXY`` is empty) asks the proxy even for a server the agent runs itself (OpenCode's own
on 127.0.0.1:4096). The proxy cannot reach into the agent's namespace, so it asks the relay for a
connection there (``OwnLoopback``); where nothing listens, the request is refused as any other
private destination. The host's loopback is reached only through ``host_ports``.

A refusal is a ``403`` whose one-line body names the destination and the key that would allow
it, reported to the session (``EgressSession.refused``: the ``network_refused`` journal entry and
the counts ``session show`` and ``status`` give); a destination that cannot be resolved or reached
is a ``502``.

Why not a library: the proxy must take connections as descriptors from a Unix socket, judge the
address it connects to after resolving (so a name cannot be re-resolved to a private address
between the check and the connect), and report each refusal with the session it belongs to.
proxy.py, pproxy and mitmproxy run their own servers and resolve inside their connectors; the
part we need (CONNECT, absolute-URI forwarding with the head rewritten, a byte copy) is this
module and ``tunnel``, on asyncio.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

from daemon.agentctl.egress import request as http
from daemon.agentctl.egress import tunnel
from daemon.agents.network import NetworkPolicy, Refusal, normalise_host, parse_ip
from ipc.aio import within

log = logging.getLogger("kandev.agentctl.egress")

HEAD_TIMEOUT_S = 30.0
RESOLVE_TIMEOUT_S = 20.0
RESOLVER_THREADS = 8
CONNECT_TIMEOUT_S = 15.0

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[list[Address]]]
OwnLoopback = Callable[[Address, int], Awaitable[socket.socket | None]]
"""A connection to the agent's own loopback, made inside its namespace by its relay (None: nothing
listens there)."""
LOCALHOST = (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1"))


class EgressSession(Protocol):
    """What a connection needs of its session (``daemon.agentctl.egress.listener.SessionEgress``)."""

    policy: NetworkPolicy

    def refused(self, host: str, port: int, refusal: Refusal) -> None: ...


_RESOLVERS = concurrent.futures.ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="egress-resolve")


async def system_resolve(host: str, port: int) -> list[Address]:
    """The addresses ``host`` resolves to here (the control server's resolver), on threads of the
    proxies' own: agents asking for slow names never hold up the server's other work in threads."""
    loop = asyncio.get_running_loop()
    infos = await within(loop.run_in_executor(_RESOLVERS, functools.partial(
        socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)), RESOLVE_TIMEOUT_S)
    out: list[Address] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        ip = ipaddress.ip_address(sockaddr[0])
        if ip not in out:
            out.append(ip)
    return out


def _answer(status: str, body: str) -> bytes:
    data = (body.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    return (f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode("ascii") + data


def refusal_body(host: str, port: int, refusal: Refusal) -> str:
    """The one line a refused request gets: the destination, why, and what would allow it."""
    shown = f"[{host}]" if ":" in host else host
    allow = f"; to allow it: {refusal.allow_with}" if refusal.allow_with else ""
    return f"kandev: refused {shown}:{port}: {refusal.message}{allow}"


async def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """The head (through the blank line) and whatever the peer sent after it already."""
    loop = asyncio.get_running_loop()
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            return data[: end + 4], data[end + 4:]
        if len(data) > http.MAX_HEAD:
            raise http.BadRequest(f"request head larger than {http.MAX_HEAD} bytes")
        chunk = await loop.sock_recv(sock, http.MAX_HEAD + 4 - len(data))
        if not chunk:
            raise ConnectionResetError("the peer closed before its head ended")
        data += chunk


async def _answer_once(upstream: socket.socket, client: socket.socket) -> None:
    """Copy the destination's answer to a plain HTTP request, its head with ``Connection: close``."""
    try:
        head, rest = await within(_read_head(upstream), HEAD_TIMEOUT_S * 4)
    except (http.BadRequest, TimeoutError, ConnectionError, OSError):
        return
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):
        await loop.sock_sendall(client, http.close_connection(head) + rest)
        await tunnel.one_way(upstream, client)


def _no_delay(sock: socket.socket) -> None:
    """Each write goes out at once (as asyncio's own transports set it): the proxy only relays."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _connect(addresses: list[Address], port: int) -> socket.socket:
    """A connection to the first of ``addresses`` that answers, by address (never by name)."""
    loop = asyncio.get_running_loop()
    last: BaseException | None = None
    for ip in addresses:
        sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            _no_delay(sock)
            await within(loop.sock_connect(sock, (str(ip), port)), CONNECT_TIMEOUT_S)
            return sock
        except (OSError, TimeoutError) as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise ConnectionError(f"cannot connect: {last}")


async def _admitted(session: EgressSession, req: http.Request, resolve: Resolve) -> list[Address] | Refusal:
    """The addresses the request may be connected to, or why none."""
    policy = session.policy
    refusal = policy.check_name(req.host, req.port)
    if refusal is not None:
        return refusal
    literal = parse_ip(req.host)
    try:
        addresses = [literal] if literal is not None else await resolve(req.host, req.port)
    except (OSError, UnicodeError, TimeoutError) as exc:
        return Refusal("unresolvable", f"cannot resolve {req.host}: {exc or 'no answer in time'}")
    admitted = [ip for ip in addresses if policy.check_address(ip, req.port) is None]
    if admitted:
        return admitted
    if not addresses:
        return Refusal("unresolvable", f"{req.host} resolves to no address")
    found = policy.check_address(addresses[0], req.port)
    assert found is not None
    if literal is None:
        return Refusal(found.reason, f"it resolves to {addresses[0]}, {found.message}", found.allow_with)
    return found


def own_loopback_targets(host: str) -> tuple[Address, ...]:
    """Where on the agent's own loopback ``host`` is: a loopback address, or ``localhost``."""
    ip = parse_ip(host)
    if ip is not None:
        return (ip,) if ip.is_loopback else ()
    name = normalise_host(host)
    return LOCALHOST if name == "localhost" or name.endswith(".localhost") else ()


async def _own_loopback(req: http.Request, own: OwnLoopback | None) -> socket.socket | None:
    for ip in own_loopback_targets(req.host) if own is not None else ():
        assert own is not None
        local = await own(ip, req.port)
        if local is not None:
            return local
    return None


async def serve(sock: socket.socket, session: EgressSession, resolve: Resolve = system_resolve,
                own: OwnLoopback | None = None, judged: Callable[[], None] = lambda: None) -> None:
    """Proxy one agent connection (see the module docstring); never raises. ``own``: a connection
    to the agent's own loopback, for a loopback destination ``host_ports`` does not list (the agent's
    own server, e.g. OpenCode's; nothing of the host's); ``judged`` runs once that is decided."""
    loop = asyncio.get_running_loop()
    upstream: socket.socket | None = None
    try:
        sock.setblocking(False)
        _no_delay(sock)
        try:
            head, rest = await within(_read_head(sock), HEAD_TIMEOUT_S)
            req = http.parse(head)
        except http.BadRequest as exc:
            await loop.sock_sendall(sock, _answer("400 Bad Request", f"kandev: {exc}"))
            return
        except (TimeoutError, ConnectionError, OSError):
            return
        verdict = await _admitted(session, req, resolve)
        local = await _own_loopback(req, own) if isinstance(verdict, Refusal) else None
        judged()
        log.debug("egress %s %s:%d: %s", "CONNECT" if req.connect else "http", req.host, req.port,
                  "own loopback" if local is not None else verdict.reason if isinstance(verdict, Refusal) else "out")
        if local is not None:
            upstream = local
            upstream.setblocking(False)
        elif isinstance(verdict, Refusal):
            if verdict.reason == "unresolvable":
                await loop.sock_sendall(sock, _answer("502 Bad Gateway", f"kandev: {verdict.message}"))
                return
            session.refused(req.host, req.port, verdict)
            await loop.sock_sendall(sock, _answer("403 Forbidden", refusal_body(req.host, req.port, verdict)))
            return
        else:
            try:
                upstream = await _connect(verdict, req.port)
            except ConnectionError as exc:
                await loop.sock_sendall(sock, _answer("502 Bad Gateway", f"kandev: {req.host}:{req.port}: {exc}"))
                return
        if req.connect:
            await loop.sock_sendall(sock, b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            await loop.sock_sendall(upstream, req.head)
        if rest:
            await loop.sock_sendall(upstream, rest)
        if req.connect:
            await tunnel.both_ways(sock, upstream)
            return
        # Plain HTTP: one request per connection. The answer's head says so (a client that kept the
        # connection for its next request would send it to this destination unjudged, or wait), and
        # the client's side is closed once the answer has ended.
        sending = asyncio.ensure_future(tunnel.one_way(sock, upstream))
        try:
            await _answer_once(upstream, sock)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    except asyncio.CancelledError:
        raise
    except Exception:  # one connection never costs the server anything
        pass
    finally:
        for end in (sock, upstream):
            if end is not None:
                with contextlib.suppress(Exception):
                    end.close()
