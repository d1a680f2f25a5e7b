"""daemon.agentctl.client.connection: a call that meets a control server's re-exec is sent again
on a new connection (Issue 15 item 6, Issue 15 scenario D: in-place reloads), also when the
server's close reached the client only after the call left (found by tests/integration/test_reload_random.py: a backend's
``confirm_rotation`` during adoption failed ``unavailable``, so it refused the server it had just
rotated and started a second one)."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.agentctl.client import connection
from daemon.agentctl.client.connection import AgentctlClient
from ipc.errors import ErrorCode, IpcError
from tests.support.aio import run

INFO = {"server_identity": "s1", "capabilities": ["x"], "credential_role": "current"}


class Conn:
    """A connection: answers every call, or fails it as a connection the server closed does."""

    def __init__(self, fail: IpcError | None = None, closed_by: IpcError | None = None) -> None:
        self.fail, self.closed_by, self.calls = fail, closed_by, 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, op: str, args: Any, timeout: float | None = None) -> Any:
        self.calls += 1
        if self.fail is not None:
            self._closed = True
            raise self.fail.copy()
        return {"op": op}

    async def close(self) -> None:
        self._closed = True


def _client(first: Conn, second: Conn, monkeypatch: pytest.MonkeyPatch) -> AgentctlClient:
    monkeypatch.setattr(connection, "_RETRY_PAUSE_S", 0.0)
    client = AgentctlClient("/nonexistent.sock", first, INFO, credential=b"c", installation_id="i",  # type: ignore[arg-type]
                            timeout=1.0)

    async def reconnect(patient_until: float | None) -> Any:
        client._conn = second  # type: ignore[assignment]
        return second

    monkeypatch.setattr(client, "_reconnect", reconnect)
    return client


def test_a_call_sent_on_a_connection_the_reexec_closed_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15 scenario D: closed by the server to re-execute, the call never ran: sent again."""
    reloading = IpcError(ErrorCode.RELOADING, "the control server is re-executing: connect again")
    first = Conn(IpcError(ErrorCode.UNAVAILABLE, "connection to s is closed after: the control server is"
                                                 " re-executing: connect again"), closed_by=reloading)
    second = Conn()
    client = _client(first, second, monkeypatch)
    assert run(client.call("confirm_rotation", {"rotation_id": 2})) == {"op": "confirm_rotation"}
    assert (first.calls, second.calls) == (1, 1)


def test_a_connection_lost_for_another_reason_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15 item 6: a connection that ended otherwise (the server died) is not a re-exec: the
    call may have run, so it fails and is not sent again."""
    first = Conn(IpcError(ErrorCode.UNAVAILABLE, "connection to s lost: EOF"),
                 closed_by=IpcError(ErrorCode.UNAVAILABLE, "connection to s lost: EOF"))
    second = Conn()
    client = _client(first, second, monkeypatch)
    with pytest.raises(IpcError) as raised:
        run(client.call("confirm_rotation", {"rotation_id": 2}))
    assert raised.value.code == ErrorCode.UNAVAILABLE and second.calls == 0
