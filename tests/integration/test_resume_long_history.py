"""Issue 45 scenario A (Issue 45 item 1): a session with a long history is resumed quickly.

The chaos run under systemd (tests/systemd/test_chaos_systemd.py) failed after about 580 faults:
after a control-server SIGKILL every session is resumed (``session/load``), and by then each had
streamed hundreds of thousands of chunks; the mock agent replayed its history one ``session/update``
per stored chunk, each written and drained on its own (~40 us a chunk: 200,000 chunks kept one
resume STARTING ~8 s, six sessions at once past the 30 s bound). Real agents replay a
conversation message by message; so does the mock now. Checked here by what crosses the wire
(the handshake's ``handshake_seq`` counts the replayed updates), never by a clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from daemon.agentctl.protocol import EventKind
from tests.support.agentctl import STEP, Server
from tests.support.aio import run
from tests.support.streams import collect_until, turn_ended

pytestmark = pytest.mark.timeout(120)
FLOOD = 1000  # its chunks joined (about 9 KB) fit in one replayed message


async def _events(client: Any, instance_id: str, upto: int) -> list[Any]:
    stream = await client.attach(instance_id, after_seq=0)
    out: list[Any] = []
    try:
        while not out or out[-1].seq < upto:
            out.append(await asyncio.wait_for(stream.__anext__(), STEP))
    finally:
        await stream.close()
    return out


def test_load_replays_a_flooded_turn_as_one_message_not_one_update_per_chunk(server: Server) -> None:
    """Issue 45 scenario A: ``/flood 1000`` then a plain turn; the resume's ``session/load``
    replays 4 messages (not 1,003 updates), the flood's chunks joined in order into one."""

    async def scenario() -> None:
        async with await server.connect() as client:
            created = await server.create(client)
            iid = created["instance_id"]
            stream = await client.attach(iid, 0)  # read as it streams (a detached log parks the flood)
            try:
                for text in (f"/flood {FLOOD}", "hello"):
                    await collect_until(stream, turn_ended(await client.prompt(iid, text)))
            finally:
                await stream.close()
            await client.stop_instance(iid)
            loaded = await server.create(client, resume_session_id=created["acp_session_id"])
            assert loaded["handshake_seq"] == 4, loaded["handshake_seq"]
            events = await _events(client, loaded["instance_id"], 4)
            assert all(e.kind == EventKind.SESSION_UPDATE and e.data["turn_id"] is None for e in events)
            replayed = [(e.data["update"]["sessionUpdate"], e.data["update"]["content"]["text"]) for e in events]
            flood = "".join(f"{i}/{FLOOD} " for i in range(1, FLOOD + 1))
            assert replayed == [("user_message_chunk", f"/flood {FLOOD}"), ("agent_message_chunk", flood),
                                ("user_message_chunk", "hello"), ("agent_message_chunk", "echo: hello")]

    run(scenario())
