"""Control-server half of the context-reset rules (RESETCFG): set_mode, set_config_option, reset_context, and what
create_instance reports, against the real server and the real mock agent.

The backend side (capture, restore, reset-context, workflow) is in test_runtime_config.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon.agentctl.protocol import EventKind
from ipc.errors import ErrorCode, IpcError
from tests.support.agentctl import STEP, Server
from tests.support.aio import run
from tests.support.streams import wait_outcome

pytestmark = pytest.mark.timeout(120)


def _options(options: list[dict[str, Any]]) -> dict[str, Any]:
    return {o["id"]: (o.get("category"), o.get("currentValue")) for o in options}


async def _events(client: Any, instance_id: str, upto: int) -> list[Any]:
    stream = await client.attach(instance_id, after_seq=0)
    out = []
    try:
        while not out or out[-1].seq < upto:
            out.append(await asyncio.wait_for(stream.__anext__(), STEP))
    finally:
        await stream.close()
    return out


def test_create_reports_modes_options_and_handshake_seq(server: Server) -> None:
    """RESETCFG-12 (the provider's report), handshake_seq after a session/load replay."""

    async def scenario() -> None:
        async with await server.connect() as client:
            created = await server.create(client)
            assert created["modes"]["currentModeId"] == "default"
            assert [m["id"] for m in created["modes"]["availableModes"]] == ["default", "plan"]
            assert _options(created["config_options"]) == {
                "model": ("model", "mock-fast"), "effort": ("thought_level", "medium")}
            assert created["handshake_seq"] == 0  # a first session/new announces nothing
            iid = created["instance_id"]
            turn = await client.prompt(iid, "hello")
            await wait_outcome(client, iid, turn)
            await client.stop_instance(iid)
            loaded = await server.create(client, resume_session_id=created["acp_session_id"])
            assert loaded["acp_session_id"] == created["acp_session_id"]
            # the replayed history (user "hello", agent "echo: hello") is numbered before the answer
            assert loaded["handshake_seq"] == 2
            events = await _events(client, loaded["instance_id"], 2)
            texts = [e.data["update"]["content"]["text"] for e in events]
            assert texts == ["hello", "echo: hello"]

    run(scenario())


def test_set_mode_and_option_accepted_and_rejected(server: Server) -> None:
    """RESETCFG-8: an accepted answer carries the agent's option list; a refusal is agent_error."""

    async def scenario() -> None:
        async with await server.connect() as client:
            created = await server.create(client)
            iid = created["instance_id"]
            res = await client.set_config_option(iid, "model", "mock-smart")
            assert _options(res["config_options"])["model"] == ("model", "mock-smart")
            assert res["acp_session_id"] == created["acp_session_id"] and res["last_seq"] >= 1
            res = await client.set_mode(iid, "plan")
            assert res["mode_id"] == "plan"
            events = await _events(client, iid, res["last_seq"])
            kinds = [e.data["update"]["sessionUpdate"] for e in events if e.kind == EventKind.SESSION_UPDATE]
            assert kinds == ["config_option_update", "current_mode_update"]
            (server.workspace / ".kandev-mock.toml").write_text('reject_option = "effort=high"\n')
            with pytest.raises(IpcError) as info:
                await client.set_config_option(iid, "effort", "high")
            assert info.value.code == ErrorCode.AGENT_ERROR and "effort=high" in info.value.message
            with pytest.raises(IpcError) as info:
                await client.set_mode(iid, "nonsense")
            assert info.value.code == ErrorCode.AGENT_ERROR

    run(scenario())


def test_reset_context_new_session_same_process_defaults_announced_first(server: Server) -> None:
    """RESETCFG-5 (ACP fast path): session/new on the same process; the new session's defaults
    are announced before the answer, so they are numbered at or below the answer's last_seq."""

    async def scenario() -> None:
        async with await server.connect() as client:
            created = await server.create(client)
            iid = created["instance_id"]
            await client.set_mode(iid, "plan")
            await client.set_config_option(iid, "effort", "high")
            reset = await client.reset_context(iid)
            assert reset["acp_session_id"] != created["acp_session_id"]
            assert reset["modes"]["currentModeId"] == "default"
            assert _options(reset["config_options"])["effort"] == ("thought_level", "medium")
            listed = {i["instance_id"]: i for i in await client.list_instances()}
            assert listed[iid]["acp_session_id"] == reset["acp_session_id"]
            assert listed[iid]["pid"] == created["pid"]  # same process
            events = await _events(client, iid, reset["last_seq"])
            tail = [e.data["update"] for e in events[-2:]]
            assert tail[0] == {"sessionUpdate": "current_mode_update", "currentModeId": "default"}
            assert tail[1]["sessionUpdate"] == "config_option_update"
            # prompts now go to the new session, which has no history
            turn = await client.prompt(iid, "after reset")
            await wait_outcome(client, iid, turn)
            new_history = (server.mock_state / f"{reset['acp_session_id']}.history.jsonl").read_text()
            assert "after reset" in new_history
            assert not (server.mock_state / f"{created['acp_session_id']}.history.jsonl").exists()

    run(scenario())
