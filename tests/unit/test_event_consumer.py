"""The backend's event consumer (``daemon.backend.state.executions.EventConsumer``) on a real store, with
a stand-in for the control server's stream: how it cuts a stream into transactions."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from daemon.backend.state import executions
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.executions import EventConsumer, Execution
from daemon.store.db import Store
from daemon.store.models import TaskSession
from ipc.client import Event
from tests.support.aio import run
from tests.support.store_rows import new_session
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)


class FakeStream:
    """An attach stream fed by the test: ``batch`` returns what was pushed, as the real one does."""

    def __init__(self) -> None:
        self.queue: deque[Event] = deque()
        self.arrived = asyncio.Event()
        self.batches: list[int] = []

    def push(self, seq: int) -> None:
        update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": f"{seq} "}}
        self.queue.append(Event(seq, "session_update", {"turn_id": None, "update": update}))
        self.arrived.set()

    async def batch(self, limit: int) -> list[Event]:
        while not self.queue:
            self.arrived.clear()
            await self.arrived.wait()
        taken = [self.queue.popleft() for _ in range(min(limit, len(self.queue)))]
        self.batches.append(len(taken))
        return taken

    async def close(self) -> None:
        pass


class FakeClient:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.acked: list[int] = []

    async def attach_shared(self, instance_id: str, after_seq: int = 0) -> FakeStream:
        return self.stream

    async def ack_events(self, instance_id: str, seq: int) -> dict[str, Any]:
        self.acked.append(seq)
        return {"discarded": 0}


def _execution(store: Store) -> Execution:
    session_id = new_session(store)
    with store.session() as db:
        task_id = db.get_one(TaskSession, session_id).task_id
    return Execution(session_id, task_id, "instance-1", AgentIdentity(None), None)


async def _consume(store: Store, scenario: Any) -> tuple[list[int], list[int]]:
    stream = FakeStream()
    client = FakeClient(stream)
    ex = _execution(store)
    consumer = EventConsumer(store, lambda _ex: client, lambda _ex: None)  # type: ignore[arg-type, return-value]
    consumer.start(ex)
    try:
        await scenario(stream, client)
    finally:
        assert ex.consumer is not None
        ex.consumer.cancel()
        await asyncio.gather(ex.consumer, return_exceptions=True)
    return stream.batches, client.acked


def test_after_a_busy_batch_the_next_one_gathers_what_trickles_in(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood: after a batch of ``BUSY_BATCH`` events the consumer waits ``BUSY_GATHER_S``
    (lengthened here) before it takes more, so events arriving one by one meanwhile are stored in
    one transaction, not one each; every event once, in order."""
    monkeypatch.setattr(executions, "BUSY_GATHER_S", 0.5)
    busy, trickle = executions.BUSY_BATCH, 50

    async def scenario(stream: FakeStream, client: FakeClient) -> None:
        for seq in range(1, busy + 1):
            stream.push(seq)
        await eventually(lambda: client.acked == [busy], timeout=10, interval=0.01)
        for seq in range(busy + 1, busy + trickle + 1):  # one by one, the consumer free to run between
            stream.push(seq)
            await asyncio.sleep(0)
        await eventually(lambda: client.acked[-1:] == [busy + trickle], timeout=10, interval=0.01)

    batches, acked = run(_consume(store, scenario))
    assert batches == [busy, trickle]
    assert acked == [busy, busy + trickle]


def test_a_stream_at_a_persons_pace_is_stored_event_by_event_without_waiting(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches smaller than ``BUSY_BATCH`` never wait: with the wait made a minute long, each
    event is still stored and acknowledged as it comes."""
    monkeypatch.setattr(executions, "BUSY_GATHER_S", 60.0)

    async def scenario(stream: FakeStream, client: FakeClient) -> None:
        for seq in range(1, 6):
            stream.push(seq)
            await eventually(lambda: client.acked[-1:] == [seq], timeout=10, interval=0.01)  # noqa: B023 (awaited here)

    batches, acked = run(_consume(store, scenario))
    assert batches == [1, 1, 1, 1, 1] and acked == [1, 2, 3, 4, 5]
