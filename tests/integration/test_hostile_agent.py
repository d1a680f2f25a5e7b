"""What an agent writes is attacker input, down to its JSON (``daemon.agentctl.instance.agent_json``) and
its requests:

- a lone UTF-16 surrogate (``"\\ud800"``, which JavaScript's JSON.stringify writes for a string cut
  inside a surrogate pair) in any string becomes U+FFFD;
- an integer past 64 bits in what the agent says about its session becomes a string;
- whatever lies deeper than ``MAX_DEPTH`` levels is cut, and a line too deep to decode at all is
  an ``agent_error``, after which reading goes on;
- a line longer than ``MAX_LINE_BYTES`` is read to its end and dropped (an ``agent_error`` with its
  head and length), so one agent cannot make the server hold an endless line;
- past ``MAX_OPEN_PERMISSIONS`` open permission requests, a request is answered ``cancelled`` at
  once, so one agent asking without waiting cannot grow the server without bound.

Before, one lone surrogate stopped the server reading that agent ("reading the agent's stdout
failed"), a lone surrogate or a huge integer in the agent's session answer made
``create_instance`` and then ``list_instances`` unanswerable for every instance on the server (the
enumeration recovery starts with), and an event nested ~1000 deep failed the backend's store
batch at every retry. Driven on a real control server with a small real ACP agent (a script the
test writes) beside the real mock agent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.agentctl.instance.agent_json import CUT, MAX_DEPTH
from daemon.agentctl.instance.conversation import MAX_OPEN_PERMISSIONS
from daemon.agentctl.instance.pipe import MAX_LINE_BYTES
from ipc.client import Event
from tests.support.agentctl import Server
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

def update(sid, body):
    send('{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":%s,"update":%s}}' % (json.dumps(sid), body))

sent_huge = False
for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if method == "initialize":
        send('{"jsonrpc":"2.0","id":%d,"result":{"protocolVersion":1,"agentCapabilities":{},'
             '"agentInfo":{"name":"cut \\udc80 name","version":"1"}}}' % mid)
    elif method == "session/new":
        send('{"jsonrpc":"2.0","id":%d,"result":{"sessionId":"lone-\\ud800-id",'
             '"modes":{"currentModeId":"m\\udfff","availableModes":[{"id":"m\\udfff","name":"\\ud800",'
             '"_meta":{"n":123456789012345678901234567890}}]}}}' % mid)
    elif method == "session/prompt":
        sid = msg["params"]["sessionId"]
        for text in ("cut \\ud83d", "\\ud83d\\ude00 whole"):
            update(sid, '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"%s"},"k\\udc00ey":1}' % text)
        update(sid, '{"sessionUpdate":"tool_call","toolCallId":"t1","title":"deep","rawInput":%s}' % ("[" * 200 + "]" * 200))
        update(sid, '{"sessionUpdate":"tool_call","toolCallId":"t2","title":"deeper","rawInput":%s}' % ("[" * 50000 + "]" * 50000))
        if not sent_huge:  # once: 48 MiB on one line, three times what one message may be
            sent_huge = True
            sys.stdout.write('{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"pad":"')
            for _ in range(48):
                sys.stdout.write("p" * (1024 * 1024))
            send('"}}}')
        update(sid, '{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"after"}}')
        send('{"jsonrpc":"2.0","id":%d,"result":{"stopReason":"end_turn","_meta":{"x":"\\udbff","d":%s}}}'
             % (mid, "[" * 300 + "]" * 300))
    elif mid is not None:
        send(json.dumps({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no"}}))
'''


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_hostile_json_from_an_agent_is_made_safe_and_nothing_stops(server: Server) -> None:
    """The hostile agent starts; ``list_instances`` answers for it and for a mock beside it (its
    session id and modes cleaned, the huge integer a string); both of its turns stream every chunk
    in order, U+FFFD where a lone surrogate was and the escaped pair intact, the deep tool call cut
    at ``MAX_DEPTH`` levels, the undecodable one an ``agent_error``, and each turn ends
    ``end_turn`` (its answer was deep too); the mock's turn works after."""
    script = server.workspace / "hostile_agent.py"
    script.write_text(HOSTILE_AGENT)

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], list[list[Event]], list[Event]]:
        async with await server.connect() as client:
            hostile = await server.create(client, session_id="hostile", command=[sys.executable, str(script)],
                                          agent="hostile")
            mock = await server.create(client, session_id="bystander")
            listed = await client.list_instances()
            peak_before = _peak_kib(server)
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
            peak_growth_kib.append(_peak_kib(server) - peak_before)
            return hostile, listed, turns, bystander

    peak_growth_kib: list[int] = []
    hostile, listed, turns, bystander = run(scenario())
    assert hostile["acp_session_id"] == "lone-\ufffd-id"
    by_session = {entry["session_id"]: entry for entry in listed}
    assert set(by_session) == {"hostile", "bystander"}
    entry = by_session["hostile"]
    assert entry["acp_session_id"] == "lone-\ufffd-id" and entry["state"] == "running"
    assert entry["modes"]["currentModeId"] == "m\ufffd"
    assert entry["modes"]["availableModes"][0]["_meta"] == {"n": "123456789012345678901234567890"}
    for events in turns:
        assert chunks(events) == ["cut \ufffd", "\U0001F600 whole", "after"]
        said = [e.data["update"] for e in events if e.kind == "session_update"]
        assert ["k\ufffdey" in u for u in said if "content" in u] == [True, True, False]
        updates = {u["toolCallId"]: u for u in said if "toolCallId" in u}
        deep = updates["t1"]["rawInput"]
        assert _depth(deep) == MAX_DEPTH - 3  # message > params > update > rawInput: cut below MAX_DEPTH
        inner = deep
        while inner != CUT:
            (inner,) = inner
        assert "t2" not in updates
        errors = [e.data["message"] for e in events if e.kind == "agent_error"]
        assert "not JSON-RPC" in errors[0] and "longer than" not in errors[0]  # too deep to decode
        head = '{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"pad":"'
        tail = '"}}}'
        assert errors[1:] == ([] if events is turns[1] else [
            f"the agent wrote a line that is not JSON-RPC: {head}{'p' * (200 - len(head))}..."
            f" ({len(head) + 48 * 1024 * 1024 + len(tail)} bytes, longer than the {MAX_LINE_BYTES} a message may"
            " be: dropped)"])
        assert events[-1].data["stop_reason"] == "end_turn" and events[-1].data["error"] is None
    assert chunks(bystander) == ["1/2 ", "2/2 "]
    # The 48 MiB line was never held whole: the server's peak memory grew by less than the line.
    assert peak_growth_kib[0] < 48 * 1024, peak_growth_kib


def _peak_kib(server: Server) -> int:
    assert server.proc is not None
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


PERMISSION_FLOOD_AGENT = r'''
import json, sys

ASKED = int(sys.argv[1])

def send(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

prompt_id, sid, cancelled = None, None, 0
for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"protocolVersion": 1, "agentCapabilities": {}}})
    elif method == "session/new":
        send({"jsonrpc": "2.0", "id": mid, "result": {"sessionId": "flood"}})
    elif method == "session/prompt":
        prompt_id, sid = mid, msg["params"]["sessionId"]
        for i in range(ASKED):  # all at once, none waited for
            send({"jsonrpc": "2.0", "id": 10_000 + i, "method": "session/request_permission", "params": {
                "sessionId": sid, "toolCall": {"toolCallId": "t", "title": f"ask {i}", "kind": "other"},
                "options": [{"optionId": "allow", "name": "Allow", "kind": "allow_once"}]}})
    elif method is None and isinstance(mid, int) and mid >= 10_000:
        cancelled += msg.get("result", {}).get("outcome", {}).get("outcome") == "cancelled"
        if cancelled == ASKED - int(sys.argv[2]):  # every request past the bound answered
            send({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": sid, "update": {
                "sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": f"cancelled {cancelled}"}}}})
            send({"jsonrpc": "2.0", "id": prompt_id, "result": {"stopReason": "end_turn"}})
    elif mid is not None and method is not None:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no"}})
'''


def test_permission_requests_past_the_bound_are_cancelled_at_once(server: Server) -> None:
    """An agent that asks 3x ``MAX_OPEN_PERMISSIONS`` permissions without waiting: the first
    ``MAX_OPEN_PERMISSIONS`` are open (events the backend would show), every other one is answered
    ``cancelled`` at once with an ``agent_error`` saying why, the agent's turn goes on and ends;
    an open one is still answered as the backend says."""
    script = server.workspace / "permission_flood.py"
    script.write_text(PERMISSION_FLOOD_AGENT)
    asked = 3 * MAX_OPEN_PERMISSIONS

    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            flood = await server.create(client, session_id="flood", agent="flood",
                                        command=[sys.executable, str(script), str(asked), str(MAX_OPEN_PERMISSIONS)])
            stream = await client.attach(flood["instance_id"], 0)
            try:
                turn = await client.prompt(flood["instance_id"], "go")
                events = await collect_until(stream, turn_ended(turn))
                first = next(e for e in events if e.kind == "permission_request")
                await client.respond_permission(flood["instance_id"], first.data["request_id"], "allow")
                return events
            finally:
                await stream.close()

    events = run(scenario())
    requests = [e for e in events if e.kind == "permission_request"]
    refusals = [e.data["message"] for e in events if e.kind == "agent_error"]
    assert len(requests) == MAX_OPEN_PERMISSIONS
    assert [r.data["tool_call"]["title"] for r in requests] == [f"ask {i}" for i in range(MAX_OPEN_PERMISSIONS)]
    assert refusals == [f"permission request cancelled unasked: the agent already has {MAX_OPEN_PERMISSIONS} open"] * (
        asked - MAX_OPEN_PERMISSIONS)
    assert chunks(events) == [f"cancelled {asked - MAX_OPEN_PERMISSIONS}"]
    assert events[-1].data["stop_reason"] == "end_turn"
