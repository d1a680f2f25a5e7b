"""A launch never starts an agent unsandboxed behind the policy's back (Issue 10 with Issue 15).

A control server of release 0.1.0 (no ``sandbox.v1``) drops ``create_instance``'s unknown ``sandbox``
field and would run the agent unsandboxed; a backend of this version adopts such a server and
keeps using it until it can replace it. ``AgentctlClient.create_instance`` therefore refuses the
launch itself, with ``sandbox_unavailable`` and nothing sent, when the policy requires the sandbox,
and leaves the field out when the policy is ``off``. The connection here is a recording stand-in
(only its ``call`` is used); the wire behaviour of both server versions is covered by
tests/integration/test_version_skew.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.protocol import CAPABILITIES, REQUIRED_CAPABILITIES
from daemon.agentctl.sandbox.bubblewrap import SandboxPolicy, SandboxRequest
from ipc.errors import ErrorCode, IpcError


class RecordingConn:
    closed = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any] | None]] = []

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        self.calls.append((op, args))
        return {"instance_id": "i1"}


def _client(capabilities: tuple[str, ...], protocol: list[int]) -> tuple[AgentctlClient, RecordingConn]:
    conn = RecordingConn()
    info = {"server_identity": "ab" * 16, "capabilities": list(capabilities), "protocol_version": protocol}
    client = AgentctlClient("/run/a.sock", conn, info, credential=b"\0" * 32, installation_id="x", timeout=5.0)
    return client, conn


def _launch(client: AgentctlClient, policy: SandboxPolicy) -> Any:
    request = SandboxRequest(policy=policy, writable=("/state",), hidden=("/home",)).to_wire()
    return asyncio.run(client.create_instance(session_id="s", task_id="t", command=["agent"], cwd="/w",
                                              sandbox=request))


def test_a_server_with_the_sandbox_gets_the_request() -> None:
    client, conn = _client(CAPABILITIES, [1, 1])
    _launch(client, SandboxPolicy.REQUIRED)
    (op, args), = conn.calls
    assert op == "create_instance" and args is not None and args["sandbox"]["policy"] == "required"


def test_a_server_without_the_sandbox_gets_no_required_launch() -> None:
    client, conn = _client(REQUIRED_CAPABILITIES, [1, 0])
    with pytest.raises(IpcError) as info:
        _launch(client, SandboxPolicy.REQUIRED)
    assert info.value.code == ErrorCode.SANDBOX_UNAVAILABLE and info.value.retryable
    assert "protocol 1.0" in info.value.message and "predates the agent sandbox" in info.value.message
    assert conn.calls == []  # nothing was sent: no agent started


def test_policy_off_on_an_old_server_launches_without_the_field() -> None:
    client, conn = _client(REQUIRED_CAPABILITIES, [1, 0])
    _launch(client, SandboxPolicy.OFF)
    (op, args), = conn.calls
    assert op == "create_instance" and args is not None and "sandbox" not in args
