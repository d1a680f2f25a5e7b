"""The egress proxy's copy (daemon.agentctl.egress.tunnel) under ``proxy.serve``, over real loopback
TCP connections (Issue 44 scenario B): a CONNECT tunnel carries megabytes both ways with a
half-close, through ``splice`` and through the fallback loop; a plain HTTP answer is rewritten and
copied whole; a refusal is still a 403 with one line; a reset on one side ends the other.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from daemon.agentctl.egress import proxy, tunnel
from daemon.agents.network import NetworkPolicy, Refusal, effective_policy
from tests.support.aio import run

MIB = 1024 * 1024


class _Session:
    def __init__(self, policy: NetworkPolicy) -> None:
        self.policy = policy
        self.refusals: list[tuple[str, int, Refusal]] = []

    def refused(self, host: str, port: int, refusal: Refusal) -> None:
        self.refusals.append((host, port, refusal))


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _through_proxy(handler: Handler, client: Callable[[socket.socket, int], Any],
                         listed: bool = True) -> tuple[Any, _Session]:
    """Run ``handler`` as a loopback server, the proxy on an accepted connection (as the relay hands
    it over), and ``client(sock, server_port)`` in a thread on the other end of that connection."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = _Session(effective_policy("allow-list", (), (f"127.0.0.1:{port}",) if listed else (), "test"))
    relay = socket.create_server(("127.0.0.1", 0))
    agent = socket.create_connection(relay.getsockname())
    handed, _ = relay.accept()
    relay.close()
    serving = asyncio.ensure_future(proxy.serve(handed, session))
    try:
        with agent:
            agent.settimeout(30)
            result = await asyncio.to_thread(client, agent, port)
        await asyncio.wait_for(serving, 30)
    finally:
        serving.cancel()
        server.close()
        await server.wait_closed()
    return result, session


def _connect_answer(sock: socket.socket, port: int) -> bytes:
    sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(4096)
        if not data:
            break
        answer += data
    return answer


def _receive_all(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    while True:
        data = sock.recv(MIB)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


async def _digest_then_send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the client's bytes to their end, then answer their sha256 and 8 MiB of a pattern."""
    seen = hashlib.sha256()
    while data := await reader.read(MIB):
        seen.update(data)
    writer.write(seen.digest())
    for i in range(8):
        writer.write(bytes([i]) * MIB)
        await writer.drain()
    writer.close()


def _tunnel_client(sock: socket.socket, port: int) -> tuple[bytes, bytes, bytes]:
    answer = _connect_answer(sock, port)
    sent = os.urandom(3 * MIB)
    sock.sendall(sent)
    sock.shutdown(socket.SHUT_WR)  # the half-close must reach the server, the answer still come back
    return answer, hashlib.sha256(sent).digest(), _receive_all(sock)


def _check_tunnel(result: tuple[bytes, bytes, bytes]) -> None:
    answer, sent_digest, received = result
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n"
    assert received[:32] == sent_digest
    assert received[32:] == b"".join(bytes([i]) * MIB for i in range(8))


def test_a_connect_tunnel_is_spliced_both_ways_and_keeps_a_half_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 scenario B: megabytes each way through a CONNECT tunnel, the kernel's copy."""
    spliced = [0]
    real_splice = os.splice

    def counting(*args: Any, **kwargs: Any) -> int:
        moved = real_splice(*args, **kwargs)
        spliced[0] += moved
        return moved

    monkeypatch.setattr(os, "splice", counting)
    grown = _count_growths(monkeypatch)
    result, session = run(_through_proxy(_digest_then_send, _tunnel_client), 60)
    _check_tunnel(result)
    assert spliced[0] >= 2 * (3 + 8) * MIB  # each byte into a pipe and out of it: none through Python
    assert grown == [tunnel.PIPE_SIZE, tunnel.PIPE_SIZE]  # each bulk direction's pipe, once
    assert session.refusals == []


def _count_growths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes the tunnel asks its pipes to grow to, from now on."""
    grown: list[int] = []
    real_fcntl = fcntl.fcntl

    def recording(fd: int, cmd: int, arg: int = 0) -> Any:
        if cmd == fcntl.F_SETPIPE_SZ:
            grown.append(arg)
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", recording)
    return grown


async def _echo_lines(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := await reader.readline():
        writer.write(line)
        await writer.drain()
    writer.close()


def test_a_conversation_of_small_messages_keeps_the_default_pipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 scenario B: a tunnel that carries small messages (a model's streamed answer) never
    grows its pipes: every pipe of the server's user counts against the system's soft limit."""

    def client(sock: socket.socket, port: int) -> list[bytes]:
        _connect_answer(sock, port)
        lines = []
        for i in range(50):
            sock.sendall(b"event %d\n" % i)
            lines.append(sock.recv(100))
        sock.shutdown(socket.SHUT_WR)
        return lines

    grown = _count_growths(monkeypatch)
    lines, _ = run(_through_proxy(_echo_lines, client), 60)
    assert lines == [b"event %d\n" % i for i in range(50)]
    assert grown == []


def test_without_splice_the_copy_loop_carries_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 scenario B: where the kernel refuses splice on a socket, the copy loop does it."""

    def refused(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EINVAL, "splice refused")

    monkeypatch.setattr(os, "splice", refused)
    result, _ = run(_through_proxy(_digest_then_send, _tunnel_client), 60)
    _check_tunnel(result)


async def _http_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    body = b"y" * (2 * MIB + 7)
    closing = int(b"\r\nConnection: close\r\n" in head)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nKeep-Alive: timeout=5\r\nX-Head: %s\r\nX-Close: %d\r\n\r\n"
                 % (len(body), head.split(b"\r\n")[0].replace(b" ", b"_"), closing) + body)
    await writer.drain()
    writer.close()  # the request said Connection: close


def test_a_plain_http_answer_is_rewritten_and_copied_whole() -> None:
    """Issue 44 scenario B: an absolute-URI request goes out in origin form; its answer comes back
    with ``Connection: close`` and the whole body, and the connection then ends."""

    def client(sock: socket.socket, port: int) -> bytes:
        sock.sendall(f"GET http://127.0.0.1:{port}/file?x=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     "Proxy-Connection: keep-alive\r\n\r\n".encode())
        return _receive_all(sock)

    received, _ = run(_through_proxy(_http_answer, client), 60)
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK"
    assert b"X-Head: GET_/file?x=1_HTTP/1.1" in lines and b"X-Close: 1" in lines
    assert b"Connection: close" in lines and not any(line.startswith(b"Keep-Alive") for line in lines)
    assert body == b"y" * (2 * MIB + 7)


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def test_an_unlisted_loopback_port_is_still_a_403_with_one_line() -> None:
    """Issue 44 scenario B: a loopback server host_ports does not list is refused, and reported."""

    def client(sock: socket.socket, port: int) -> bytes:
        sock.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        return _receive_all(sock)

    answer, session = run(_through_proxy(_silent, client, listed=False), 60)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 Forbidden")
    assert body.count(b"\n") == 1 and b"host_ports" in body
    assert [(h, r.reason) for h, _p, r in session.refusals] == [("127.0.0.1", "private_address")]


async def _reset_midway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"z" * MIB)
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    writer.transport.abort()


def test_a_reset_on_the_destination_ends_the_agent_side_too() -> None:
    """Issue 44 scenario B: the destination resets while the agent's side is still open and
    silent; the tunnel ends (the agent reads an end, not a hang) and the proxy's task returns."""

    def client(sock: socket.socket, port: int) -> tuple[bytes, int]:
        answer = _connect_answer(sock, port)
        got = 0
        try:
            while data := sock.recv(MIB):
                got += len(data)
        except ConnectionResetError:
            pass
        return answer, got

    (answer, got), _ = run(_through_proxy(_reset_midway, client), 60)
    assert answer.startswith(b"HTTP/1.1 200")
    assert got <= MIB
