"""Recovery in bulk (daemon.backend.recovery.batch): reads coalesced, writes in one transaction,
the per-record outcomes unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import select

from daemon.backend.recovery.batch import STATUS_CHUNK, TurnStatusReader, WriteBatch
from daemon.store.models import Task
from ipc.errors import ErrorCode, IpcError


class FakeServer:
    """The two read ops of a control server, counting the exchanges."""

    def __init__(self, instances: set[str], *, bulk: bool = True, unknown_op: bool = False) -> None:
        self.instances = instances
        self.supports_turn_statuses = bulk
        self.unknown_op = unknown_op
        self.bulk_calls: list[int] = []
        self.single_calls = 0

    async def turn_statuses(self, ids: list[str]) -> dict[str, Any]:
        self.bulk_calls.append(len(ids))
        if self.unknown_op:
            raise IpcError(ErrorCode.UNKNOWN_OP, "unknown op turn_statuses")
        return {"statuses": {i: {"current_turn_id": f"t-{i}", "outcomes": []} for i in ids if i in self.instances},
                "missing": [i for i in ids if i not in self.instances]}

    async def turn_status(self, instance_id: str) -> dict[str, Any]:
        self.single_calls += 1
        if instance_id not in self.instances:
            raise IpcError(ErrorCode.NOT_FOUND, f"no instance {instance_id!r}")
        return {"current_turn_id": f"t-{instance_id}", "outcomes": []}


async def _budget(fn: Callable[[], Awaitable[Any]]) -> Any:
    return await fn()


async def _read_all(server: FakeServer, ids: list[str]) -> list[Any]:
    reader = TurnStatusReader(server, _budget)  # type: ignore[arg-type]
    return await asyncio.gather(*(reader.read(i) for i in ids), return_exceptions=True)


def test_reads_of_one_iteration_are_one_request_per_chunk_and_a_missing_instance_is_not_found():
    """AC-EXECUTORS-SURVIVAL-004.5: each record still gets its own answer (not_found for an unknown instance)."""
    ids = [f"i{n}" for n in range(STATUS_CHUNK * 2 + 7)]
    server = FakeServer(set(ids[1:]))
    results = asyncio.run(_read_all(server, ids))
    assert server.bulk_calls == [STATUS_CHUNK, STATUS_CHUNK, 7] and server.single_calls == 0
    assert isinstance(results[0], IpcError) and results[0].code == ErrorCode.NOT_FOUND
    assert [r["current_turn_id"] for r in results[1:]] == [f"t-{i}" for i in ids[1:]]


def test_an_older_server_gets_one_read_per_instance():
    """A 0.2.0 control server (protocol 1.1) has no turn_statuses: one turn_status per instance."""
    server = FakeServer({"a", "b"}, bulk=False)
    results = asyncio.run(_read_all(server, ["a", "b"]))
    assert server.bulk_calls == [] and server.single_calls == 2
    assert [r["current_turn_id"] for r in results] == ["t-a", "t-b"]


def test_unknown_op_falls_back_to_single_reads():
    server = FakeServer({"a", "b"}, unknown_op=True)
    results = asyncio.run(_read_all(server, ["a", "b"]))
    assert server.bulk_calls == [2] and server.single_calls == 2
    assert [r["current_turn_id"] for r in results] == ["t-a", "t-b"]


def _add_task(task_id: str) -> Callable[[Any], None]:
    def apply(db: Any) -> None:
        if task_id == "bad":
            raise ValueError("this record's write fails")
        db.add(Task(id=task_id, title=task_id, workspace="/w", executor="local", state="backlog"))

    return apply


def test_writes_of_one_iteration_share_one_transaction_and_a_failure_costs_only_its_record(store):
    batches: list[list[str]] = []
    published: list[str] = []

    async def run() -> list[Any]:
        writes = WriteBatch(store, admit=lambda: True, preload=lambda db, keys: batches.append(keys) or [])
        keys = ["a", "bad", "c"]
        return await asyncio.gather(
            *(writes.write(k, _add_task(k), lambda k=k: published.append(k)) for k in keys), return_exceptions=True
        )

    results = asyncio.run(run())
    assert batches == [["a", "bad", "c"]]  # one batch; it failed, then each record on its own
    assert results[0] is True and isinstance(results[1], ValueError) and results[2] is True
    assert published == ["a", "c"]
    with store.session() as db:
        assert sorted(db.scalars(select(Task.id))) == ["a", "c"]


def test_a_batch_flushed_after_the_deadline_writes_and_publishes_nothing(store):
    """AC-EXECUTORS-SURVIVAL-003.7: completed after D: publishes nothing, changes no state."""
    published: list[str] = []

    async def run() -> bool:
        writes = WriteBatch(store, admit=lambda: False)
        return await writes.write("a", _add_task("a"), lambda: published.append("a"))

    assert asyncio.run(run()) is False
    assert published == []
    with store.session() as db:
        assert list(db.scalars(select(Task.id))) == []
