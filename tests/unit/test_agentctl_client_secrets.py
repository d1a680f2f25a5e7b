"""An agent never starts without the keys its configuration gives it (Issue 12 with Issue 15).

A control server without ``agent_secrets.v1`` (release 0.1.0, or a 0.2.0 build that predates
agents' keys) drops ``create_instance``'s unknown ``secret_env`` field and would start the agent
without its keys: the very failure Issue 12 is about ("Authentication required"). The client
refuses such a launch itself (``incompatible_version``, retryable, nothing sent) and says how to get
a server that can; a launch without keys goes to any server with no ``secret_env`` field at all, so
an old server still gets a request it accepts. The connection is a recording stand-in (only its
``call`` is used).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.protocol import (
    AGENT_SECRETS_CAPABILITY,
    CAPABILITIES,
    RELOAD_CAPABILITY,
    REQUIRED_CAPABILITIES,
)
from ipc.errors import ErrorCode, IpcError

KEYS = {"ANTHROPIC_API_KEY": "/etc/kandev/secrets/anthropic-api-key"}


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


def _launch(client: AgentctlClient, secret_env: dict[str, str] | None) -> Any:
    return asyncio.run(client.create_instance(session_id="s", task_id="t", command=["agent"], cwd="/w",
                                              secret_env=secret_env))


def test_a_server_with_agent_secrets_gets_the_references() -> None:
    client, conn = _client(CAPABILITIES, [1, 1])
    _launch(client, KEYS)
    (op, args), = conn.calls
    assert op == "create_instance" and args is not None and args["secret_env"] == KEYS


@pytest.mark.parametrize("capabilities, protocol, how", [
    (REQUIRED_CAPABILITIES, [1, 0], "replaces it with the installed version once it runs no instance"),
    (tuple(c for c in CAPABILITIES if c != AGENT_SECRETS_CAPABILITY), [1, 1], "kandev agentctl reload"),
])
def test_a_server_without_agent_secrets_gets_no_launch_with_keys(capabilities, protocol, how) -> None:
    assert (RELOAD_CAPABILITY in capabilities) == (protocol == [1, 1])
    client, conn = _client(capabilities, protocol)
    with pytest.raises(IpcError) as info:
        _launch(client, KEYS)
    assert info.value.code == ErrorCode.INCOMPATIBLE_VERSION and info.value.retryable
    assert "predates agents' keys" in info.value.message and "ANTHROPIC_API_KEY" in info.value.message
    assert how in info.value.message and KEYS["ANTHROPIC_API_KEY"] not in info.value.message
    assert conn.calls == []  # nothing was sent: no agent started without its key


@pytest.mark.parametrize("secret_env", [None, {}])
def test_a_launch_without_keys_goes_to_an_old_server_without_the_field(secret_env) -> None:
    client, conn = _client(REQUIRED_CAPABILITIES, [1, 0])
    _launch(client, secret_env)
    (op, args), = conn.calls
    assert op == "create_instance" and args is not None and "secret_env" not in args
