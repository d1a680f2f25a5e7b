"""What an agent writes is attacker input, down to its JSON string escapes: a lone UTF-16
surrogate (``"\\ud800"``, which JavaScript's JSON.stringify writes for a string cut inside a
surrogate pair) in any string an agent sends becomes U+FFFD at the control server's door
(``daemon.agentctl.agent_text``).

Before, one such string stopped the server reading that agent (its conversation ended with
"reading the agent's stdout failed"), and one in the agent's ACP session id made
``list_instances`` unanswerable for every instance on the server, the enumeration recovery
starts with. Driven on a real control server with a small real ACP agent (a script the test writes)
beside the real mock agent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from ipc.client import Event
from tests.support.agentctl import Server, start_server, stop_server, write_launch
from tests.support.aio import run
from tests.support.streams import chunks, collect_until, turn_ended

pytestmark = pytest.mark.timeout(120)

# Every string it sends on its own carries a lone surrogate escape, keys included; "\ud83d\ude00"
# (an escaped pair, as ensure_ascii writers send every emoji) must stay the one character it is.
HOSTILE_AGENT = r'''
import json, sys

def send(text):
    sys.stdout.write(text + "\n")
    sys.stdout.flush()

for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if method == "initialize":
        send('{"jsonrpc":"2.0","id":%d,"result":{"protocolVersion":1,"agentCapabilities":{},'
             '"agentInfo":{"name":"cut \\udc80 name","version":"1"}}}' % mid)
    elif method == "session/new":
        send('{"jsonrpc":"2.0","id":%d,"result":{"sessionId":"lone-\\ud800-id",'
             '"modes":{"currentModeId":"m\\udfff","availableModes":[{"id":"m\\udfff","name":"\\ud800"}]}}}' % mid)
    elif method == "session/prompt":
        sid = msg["params"]["sessionId"]
        for text in ("cut \\ud83d", "\\ud83d\\ude00 whole", "after"):
            send('{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":%s,"update":'
                 '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"%s"},'
                 '"k\\udc00ey":1}}}' % (json.dumps(sid), text))
        send('{"jsonrpc":"2.0","id":%d,"result":{"stopReason":"end_turn","_meta":{"x":"\\udbff"}}}' % mid)
    elif mid is not None:
        send(json.dumps({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no"}}))
'''


@pytest.fixture
def server(private_root: Path) -> Any:
    srv = write_launch(private_root)
    try:
        start_server(srv)
        yield srv
    finally:
        stop_server(srv)


def test_lone_surrogates_from_an_agent_become_replacement_characters_and_nothing_stops(server: Server) -> None:
    """The hostile agent starts; ``list_instances`` answers for it and for a mock beside it (its
    session id and modes cleaned); both of its turns stream every chunk, in order, with U+FFFD
    where a lone surrogate was and the escaped pair intact; the mock's turn works after."""
    script = server.workspace / "hostile_agent.py"
    script.write_text(HOSTILE_AGENT)

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], list[list[Event]], list[Event]]:
        async with await server.connect() as client:
            hostile = await server.create(client, session_id="hostile", command=[sys.executable, str(script)],
                                          agent="hostile")
            mock = await server.create(client, session_id="bystander")
            listed = await client.list_instances()
            turns = []
            for _ in range(2):  # the first turn did not end its conversation
                stream = await client.attach(hostile["instance_id"], 0 if not turns else turns[-1][-1].seq)
                try:
                    turn = await client.prompt(hostile["instance_id"], "go")
                    turns.append(await collect_until(stream, turn_ended(turn)))
                finally:
                    await stream.close()
            stream = await client.attach(mock["instance_id"], 0)
            try:
                turn = await client.prompt(mock["instance_id"], "/slow 2")
                bystander = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            return hostile, listed, turns, bystander

    hostile, listed, turns, bystander = run(scenario())
    assert hostile["acp_session_id"] == "lone-\ufffd-id"
    by_session = {entry["session_id"]: entry for entry in listed}
    assert set(by_session) == {"hostile", "bystander"}
    assert by_session["hostile"]["acp_session_id"] == "lone-\ufffd-id"
    assert by_session["hostile"]["modes"]["currentModeId"] == "m\ufffd"
    assert by_session["hostile"]["state"] == "running"
    for events in turns:
        assert chunks(events) == ["cut \ufffd", "\U0001F600 whole", "after"]
        updates = [e.data["update"] for e in events if e.kind == "session_update"]
        assert all("k\ufffdey" in update for update in updates)
        assert events[-1].data["stop_reason"] == "end_turn" and events[-1].data["error"] is None
    assert chunks(bystander) == ["1/2 ", "2/2 "]
