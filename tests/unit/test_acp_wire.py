"""daemon/agents/mock/acp_wire.py, the mock agent's JSON-RPC side, over a real socket pair: how it
answers, what it skips, how its own requests are numbered and answered, and what the end of
input does to the work still running."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from daemon.agents.mock.acp_wire import PROTOCOL_VERSION, AgentWire, Params, RpcError
from tests.support.aio import run
from tests.support.waiting import eventually


class Peer:
    """The client's end: raw lines in and out."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def send(self, message: Any) -> None:
        self.writer.write((message if isinstance(message, str) else json.dumps(message)).encode() + b"\n")

    async def read(self) -> dict[str, Any]:
        return json.loads(await asyncio.wait_for(self.reader.readline(), 10))


async def _pair(requests: dict[str, Any], notifications: dict[str, Any] | None = None) -> tuple[AgentWire, Peer]:
    ours, theirs = socket.socketpair()
    r1, w1 = await asyncio.open_unix_connection(sock=ours)
    r2, w2 = await asyncio.open_unix_connection(sock=theirs)
    return AgentWire(r1, w1, requests, notifications or {}), Peer(r2, w2)


def test_results_errors_and_unknown_methods_are_answered_like_the_sdk() -> None:
    async def echo(params: Params) -> Any:
        return {"got": params}

    async def refuse(params: Params) -> Any:
        raise RpcError.invalid_params({"details": "no"})

    async def crash(params: Params) -> Any:
        raise KeyError("boom")

    async def scenario() -> list[dict[str, Any]]:
        wire, peer = await _pair({"echo": echo, "refuse": refuse, "crash": crash})
        serving = asyncio.ensure_future(wire.serve())
        peer.send("this is not json")  # logged and skipped
        peer.send([1, 2])  # not an object: skipped
        for n, method in enumerate(("echo", "refuse", "crash", "nope"), 1):
            peer.send({"jsonrpc": "2.0", "id": n, "method": method, "params": {"a": n}})
        replies = sorted([await peer.read() for _ in range(4)], key=lambda r: r["id"])
        peer.writer.write_eof()
        await asyncio.wait_for(serving, 10)
        return replies

    assert run(scenario()) == [
        {"jsonrpc": "2.0", "id": 1, "result": {"got": {"a": 1}}},
        {"jsonrpc": "2.0", "id": 2, "error": {"code": -32602, "message": "Invalid params", "data": {"details": "no"}}},
        {"jsonrpc": "2.0", "id": 3, "error": {"code": -32603, "message": "Internal error", "data": {"details": "'boom'"}}},
        {"jsonrpc": "2.0", "id": 4, "error": {"code": -32601, "message": "Method not found", "data": {"method": "nope"}}},
    ]


def test_a_notification_reaches_a_running_request_and_requests_to_the_client_are_numbered_from_0() -> None:
    async def scenario() -> tuple[list[dict[str, Any]], Any]:
        cancelled = asyncio.Event()
        wire: AgentWire

        async def prompt(params: Params) -> Any:
            first = await wire.request("ask", {"n": 1})
            try:
                await wire.request("ask", {"n": 2})
            except RpcError as exc:
                second = [exc.code, str(exc), exc.data]
            await wire.notify("said", {"text": "hi"})
            await asyncio.wait_for(cancelled.wait(), 10)
            return {"first": first, "second": second}

        async def cancel(params: Params) -> None:
            cancelled.set()

        wire, peer = await _pair({"prompt": prompt}, {"cancel": cancel})
        serving = asyncio.ensure_future(wire.serve())
        peer.send({"jsonrpc": "2.0", "id": "p", "method": "prompt", "params": {}})
        seen = [await peer.read()]
        peer.send({"jsonrpc": "2.0", "id": seen[0]["id"], "result": {"answer": 42}})
        seen.append(await peer.read())
        peer.send({"jsonrpc": "2.0", "id": seen[1]["id"], "error": {"code": -1, "message": "no", "data": None}})
        seen.append(await peer.read())
        peer.send({"jsonrpc": "2.0", "method": "unknown notification", "params": {}})  # dropped
        peer.send({"jsonrpc": "2.0", "method": "cancel", "params": {}})
        reply = await peer.read()
        peer.writer.write_eof()
        await asyncio.wait_for(serving, 10)
        return seen, reply

    seen, reply = run(scenario())
    assert seen == [
        {"jsonrpc": "2.0", "id": 0, "method": "ask", "params": {"n": 1}},
        {"jsonrpc": "2.0", "id": 1, "method": "ask", "params": {"n": 2}},
        {"jsonrpc": "2.0", "method": "said", "params": {"text": "hi"}},
    ]
    assert reply == {"jsonrpc": "2.0", "id": "p", "result": {"first": {"answer": 42}, "second": [-1, "no", None]}}


def test_end_of_input_cancels_running_requests_and_fails_those_to_the_client() -> None:
    async def scenario() -> tuple[bool, BaseException | None]:
        outcome: dict[str, Any] = {"cancelled": False, "error": None}
        wire: AgentWire

        async def prompt(params: Params) -> Any:
            try:
                await wire.request("ask", {})
            except ConnectionError as exc:
                outcome["error"] = exc
                await asyncio.sleep(3600)  # still running at the end: cancelled
            except asyncio.CancelledError:
                outcome["cancelled"] = True
                raise

        wire, peer = await _pair({"prompt": prompt})
        serving = asyncio.ensure_future(wire.serve())
        peer.send({"jsonrpc": "2.0", "id": 1, "method": "prompt", "params": {}})
        await peer.read()  # the request to the client is out
        peer.writer.write_eof()
        await asyncio.wait_for(serving, 10)
        await eventually(lambda: outcome["cancelled"], 10, message="the running request cancelled")
        with pytest.raises(ConnectionError):
            await wire.request("late", {})
        return outcome["cancelled"], outcome["error"]

    assert run(scenario()) == (True, None)


def test_the_protocol_version_is_the_sdks() -> None:
    import acp

    assert PROTOCOL_VERSION == acp.PROTOCOL_VERSION
