"""daemon.cli.call.call asks once more on a new connection only when the request could not be
written (``ipc.errors.RequestNotSent``): what a CLI call meets when a backend hands its socket
from the server that waited for disk space to the normal one. A scripted server on a real Unix
socket; "closed before the request" is made exact with ``shutdown(SHUT_RD)`` before the hello's
answer, so the client's next write fails with EPIPE every time."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.cli.call import call
from ipc.errors import ErrorCode, IpcError, RequestNotSent
from ipc.framing import HEADER
from tests.support.wire import read_frame_body

HELLO_RESULT = {"protocol": "kandev.backend", "version": [1, 0], "capabilities": [], "ops": []}


def _read_frame(conn: socket.socket) -> dict | None:
    body = read_frame_body(conn)
    return None if body is None else json.loads(body)


def _send(conn: socket.socket, obj: dict) -> None:
    body = json.dumps(obj).encode()
    conn.sendall(HEADER.pack(len(body)) + body)


class ScriptedServer:
    """Accepts connections and runs one script per connection, in order; records the requests."""

    def __init__(self, path: Path, scripts: list[Callable[[socket.socket, list[str]], None]]) -> None:
        self.requests: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        self._sock.listen(8)
        self._scripts = scripts
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for script in self._scripts:
            conn, _ = self._sock.accept()
            with conn:
                script(conn, self.requests)

    def close(self) -> None:
        self._thread.join(10)
        self._sock.close()


def _hello(conn: socket.socket, requests: list[str]) -> None:
    frame = _read_frame(conn)
    assert frame is not None and frame["op"] == "hello"
    requests.append("hello")
    _send(conn, {"id": frame["id"], "ok": True, "result": HELLO_RESULT})


def closes_before_the_request(conn: socket.socket, requests: list[str]) -> None:
    frame = _read_frame(conn)
    assert frame is not None and frame["op"] == "hello"
    requests.append("hello")
    conn.shutdown(socket.SHUT_RD)  # nothing written after this reaches the server: EPIPE
    _send(conn, {"id": frame["id"], "ok": True, "result": HELLO_RESULT})
    conn.recv(1)  # until the client hangs up


def answers(conn: socket.socket, requests: list[str]) -> None:
    _hello(conn, requests)
    frame = _read_frame(conn)
    assert frame is not None
    requests.append(frame["op"])
    _send(conn, {"id": frame["id"], "ok": True, "result": {"answer": 42}})


def reads_the_request_and_hangs_up(conn: socket.socket, requests: list[str]) -> None:
    _hello(conn, requests)
    frame = _read_frame(conn)
    assert frame is not None
    requests.append(frame["op"])


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "b.sock"


def test_a_request_the_closed_connection_never_took_is_asked_again_once(sock_path: Path) -> None:
    server = ScriptedServer(sock_path, [closes_before_the_request, answers])
    try:
        assert call(sock_path, "status", timeout=10) == {"answer": 42}
    finally:
        server.close()
    assert server.requests == ["hello", "hello", "status"]  # the status ran once


def test_a_second_connection_that_cannot_take_it_either_is_an_unavailable_error(sock_path: Path) -> None:
    server = ScriptedServer(sock_path, [closes_before_the_request, closes_before_the_request])
    try:
        with pytest.raises(RequestNotSent) as raised:
            call(sock_path, "status", timeout=10)
    finally:
        server.close()
    assert raised.value.code == ErrorCode.UNAVAILABLE and raised.value.retryable
    assert "Broken pipe" in raised.value.message and server.requests == ["hello", "hello"]


def test_a_request_that_was_written_is_never_asked_twice(sock_path: Path) -> None:
    """The server read it and hung up without an answer: it may have run, so it is not sent again."""
    server = ScriptedServer(sock_path, [reads_the_request_and_hangs_up])
    try:
        with pytest.raises(IpcError) as raised:
            call(sock_path, "task_delete", timeout=10)
    finally:
        server.close()
    assert not isinstance(raised.value, RequestNotSent) and raised.value.code == ErrorCode.UNAVAILABLE
    assert server.requests == ["hello", "task_delete"]
