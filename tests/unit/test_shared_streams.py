"""``SharedAttacher`` and ``SharedStream`` against a scripted ``attach_many`` connection.

What is checked here and not against a real server: that attaches asked in one moment become one
request and later ones another, that an attach cancelled before it went out is not asked, that
a failure to open reaches every asker, that one slow consumer stops the connection being read
(bounded memory) until it takes its events, and that a lost connection reaches every stream
after the events that came before it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from daemon.agentctl.client import shared_streams
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.shared_streams import InstanceStream, SharedAttacher
from daemon.agentctl.protocol import CAPABILITIES, REQUIRED_CAPABILITIES
from ipc.errors import ErrorCode, IpcError
from tests.support.aio import run


class ScriptedStream:
    """An ``attach_many`` stream whose frames a test feeds (``feed``, ``fail``, ``end``)."""

    def __init__(self, instances: list[list[Any]], missing: frozenset[str] = frozenset()) -> None:
        self.result = {"attached": {iid: {"next_seq": 1, "retained_events": 0, "stream": f"tok-{iid}"}
                                    for iid, _ in instances if iid not in missing},
                       "missing": [iid for iid, _ in instances if iid in missing]}
        self.frames_read = 0
        self.closed = False
        self._queue: deque[Any] = deque()
        self._arrived = asyncio.Event()

    def feed(self, *frames: dict[str, Any]) -> None:
        self._queue.extend(frames)
        self._arrived.set()

    def fail(self, error: IpcError) -> None:
        self._queue.append(error)
        self._arrived.set()

    async def frames(self, limit: int) -> list[dict[str, Any]]:
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        if isinstance(self._queue[0], IpcError):
            raise self._queue[0]
        taken = []
        while self._queue and len(taken) < limit and isinstance(self._queue[0], dict):
            taken.append(self._queue.popleft())
        self.frames_read += len(taken)
        return taken

    async def close(self) -> None:
        self.closed = True


class Opener:
    """``open_stream`` for the attacher: records each request and answers a ``ScriptedStream``."""

    def __init__(self, missing: frozenset[str] = frozenset(), error: Exception | None = None) -> None:
        self.requests: list[list[list[Any]]] = []
        self.streams: list[ScriptedStream] = []
        self.missing = missing
        self.error = error
        self.detached: list[tuple[str, str]] = []

    async def open(self, instances: list[list[Any]]) -> Any:
        self.requests.append(instances)
        if self.error is not None:
            raise self.error
        stream = ScriptedStream(instances, self.missing)
        self.streams.append(stream)
        return stream

    async def detach(self, instance_id: str, token: str) -> None:
        self.detached.append((instance_id, token))


def _events(iid: str, first: int, count: int) -> dict[str, Any]:
    return {"instance": iid, "events": [[seq, "session_update", {"n": seq}] for seq in range(first, first + count)]}


def test_attaches_asked_in_one_moment_go_out_as_one_request():
    async def scenario() -> None:
        opener = Opener(missing=frozenset({"gone"}))
        attacher = SharedAttacher(opener.open, opener.detach)
        together = await asyncio.gather(attacher.attach("a", 3), attacher.attach("b", 0),
                                        attacher.attach("gone", 0), return_exceptions=True)
        later = await attacher.attach("c", 7)
        assert opener.requests == [[["a", 3], ["b", 0], ["gone", 0]], [["c", 7]]]
        a, b, gone = together
        assert isinstance(a, InstanceStream) and isinstance(b, InstanceStream)
        assert isinstance(gone, IpcError) and gone.code == ErrorCode.NOT_FOUND
        assert a.token == "tok-a" and later.result["instance_id"] == "c"
        opener.streams[0].feed(_events("b", 1, 2), _events("a", 4, 1), {"instance": "a", "end": True})
        assert [e.seq for e in await a.batch(10)] == [4]
        assert await a.batch(10) == []  # its stream ended; b's goes on
        assert [e.seq for e in await b.batch(10)] == [1, 2]
        await attacher.close()
        assert all(s.closed for s in opener.streams)

    run(scenario())


def test_a_cancelled_attach_is_not_asked_and_a_failure_reaches_every_asker():
    async def scenario() -> None:
        opener = Opener()
        attacher = SharedAttacher(opener.open, opener.detach)
        cancelled = asyncio.ensure_future(attacher.attach("x", 0))
        kept = asyncio.ensure_future(attacher.attach("y", 0))
        await asyncio.sleep(0)  # both asked; the request is not out yet
        cancelled.cancel()
        await kept
        assert opener.requests == [[["y", 0]]]

        failing = Opener(error=IpcError(ErrorCode.UNAVAILABLE, "no server"))
        attacher = SharedAttacher(failing.open, failing.detach)
        results = await asyncio.gather(attacher.attach("a", 0), attacher.attach("b", 0), return_exceptions=True)
        assert [r.code for r in results if isinstance(r, IpcError)] == [ErrorCode.UNAVAILABLE] * 2
        assert results[0] is not results[1]

    run(scenario())


def test_a_slow_consumer_stops_the_connection_being_read_until_it_takes_its_events(monkeypatch):
    """Bounded memory: at ``QUEUE_HIGH`` waiting events the shared connection is not read."""
    monkeypatch.setattr(shared_streams, "QUEUE_HIGH", 10)

    async def scenario() -> None:
        opener = Opener()
        attacher = SharedAttacher(opener.open, opener.detach)
        a, b = await asyncio.gather(attacher.attach("a", 0), attacher.attach("b", 0))
        stream = opener.streams[0]
        stream.feed(_events("a", 1, 10), _events("b", 1, 1), _events("a", 11, 1))
        await _turns(50)  # every chance for the reader to route on (it must not: a is full)
        assert len(a._events) == 10 and len(b._events) == 0
        assert [e.seq for e in await a.batch(100)] == list(range(1, 11))
        assert [e.seq for e in await b.batch(100)] == [1]
        assert [e.seq for e in await a.batch(100)] == [11]
        await attacher.close()

    run(scenario())


async def _turns(n: int) -> None:
    """Let the event loop run ``n`` rounds (no time passes: each is a yield, not a wait)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_lost_connection_reaches_every_stream_after_its_events_and_detach_names_the_stream():
    async def scenario() -> None:
        opener = Opener()
        attacher = SharedAttacher(opener.open, opener.detach)
        a, b, c = await asyncio.gather(attacher.attach("a", 0), attacher.attach("b", 0), attacher.attach("c", 0))
        await c.detach()
        assert opener.detached == [("c", "tok-c")]
        opener.streams[0].feed(_events("a", 1, 2), _events("c", 1, 1))
        opener.streams[0].fail(IpcError(ErrorCode.UNAVAILABLE, "connection lost"))
        assert [e.seq for e in await a.batch(10)] == [1, 2]
        for s in (a, b):
            with pytest.raises(IpcError) as info:
                await s.batch(10)
            assert info.value.code == ErrorCode.UNAVAILABLE
        assert await c.batch(10) == []  # detached: what came for it was dropped, unacknowledged
        assert opener.streams[0].closed

    run(scenario())


def test_the_last_close_closes_the_connection():
    async def scenario() -> None:
        opener = Opener()
        attacher = SharedAttacher(opener.open, opener.detach)
        a, b = await asyncio.gather(attacher.attach("a", 0), attacher.attach("b", 0))
        await a.close()
        await _turns(5)
        assert not opener.streams[0].closed
        await b.close()
        await _turns(5)
        assert opener.streams[0].closed and opener.detached == []
        assert not attacher.shared

    run(scenario())



def test_a_server_without_attach_many_gets_an_attach_of_its_own(monkeypatch: pytest.MonkeyPatch):
    """Version skew: a backend adopting a 0.2.0 control server (no ``attach_many.v1``) attaches
    each instance on a connection of its own; one with it shares."""
    asked: list[tuple[str, str, int]] = []

    async def attach(self: AgentctlClient, instance_id: str, after_seq: int = 0, **_: Any) -> str:
        asked.append(("attach", instance_id, after_seq))
        return "own"

    async def shared(self: SharedAttacher, instance_id: str, after_seq: int) -> str:
        asked.append(("attach_many", instance_id, after_seq))
        return "shared"

    monkeypatch.setattr(AgentctlClient, "attach", attach)
    monkeypatch.setattr(SharedAttacher, "attach", shared)
    info = {"server_identity": "ab" * 16, "protocol_version": [1, 1]}
    old = AgentctlClient("/run/a.sock", None, {**info, "capabilities": list(REQUIRED_CAPABILITIES)},  # type: ignore[arg-type]
                         credential=b"\0" * 32, installation_id="x", timeout=5.0)
    new = AgentctlClient("/run/a.sock", None, {**info, "capabilities": list(CAPABILITIES)},  # type: ignore[arg-type]
                         credential=b"\0" * 32, installation_id="x", timeout=5.0)
    assert run(old.attach_shared("i1", 4)) == "own"
    assert run(new.attach_shared("i1", 4)) == "shared"
    assert asked == [("attach", "i1", 4), ("attach_many", "i1", 4)]
