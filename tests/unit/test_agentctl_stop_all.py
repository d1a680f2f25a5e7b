"""Stopping every instance ends the control server, so it happens once (AC-EXECUTORS-CONTROL-OWNERSHIP-002.9,
AC-EXECUTORS-CONTROL-OWNERSHIP-004.7): an ``ownership_shutdown`` that arrives while the instances stop, or
after they stopped but before the process exits, waits for the same stop and answers the same ids
(it answered ``stopped: []`` when it came after; a fresh-clone run caught the integration test so)."""

from __future__ import annotations

import asyncio
from typing import Any

from daemon.agentctl.egress.host import EgressHost
from daemon.agentctl.instances import InstanceService
from tests.support.aio import run


class _Instance:
    def __init__(self, instance_id: str, gate: asyncio.Event) -> None:
        self.instance_id = instance_id
        self.gate = gate
        self.stops = 0

    async def stop(self) -> None:
        self.stops += 1
        await self.gate.wait()


class _Server:
    def __init__(self, instances: list[_Instance]) -> None:
        self.instances: dict[str, Any] = {i.instance_id: i for i in instances}
        self.changes = 0

    def changed(self) -> None:
        self.changes += 1


def test_a_call_during_and_a_call_after_the_stop_answer_the_same_ids() -> None:
    async def scenario() -> tuple[list[str], list[str], list[str], list[int]]:
        gate = asyncio.Event()
        instances = [_Instance("a", gate), _Instance("b", gate)]
        service = InstanceService(_Server(instances), sandbox_host=None, egress=EgressHost("/nonexistent"))  # type: ignore[arg-type]
        first = asyncio.ensure_future(service.stop_all())
        during = asyncio.ensure_future(service.stop_all())
        await asyncio.sleep(0)
        assert not first.done() and not during.done()  # both wait for the agents to stop
        gate.set()
        after = await service.stop_all()
        return await first, await during, after, [i.stops for i in instances]

    first, during, after, stops = run(scenario())
    assert sorted(first) == sorted(during) == sorted(after) == ["a", "b"]
    assert stops == [1, 1]  # each agent was stopped once


def test_a_cancelled_caller_does_not_cancel_the_stop() -> None:
    async def scenario() -> list[str]:
        gate = asyncio.Event()
        service = InstanceService(_Server([_Instance("a", gate)]), sandbox_host=None,  # type: ignore[arg-type]
                                  egress=EgressHost("/nonexistent"))
        impatient = asyncio.ensure_future(service.stop_all())
        await asyncio.sleep(0)
        impatient.cancel()  # its connection went away
        gate.set()
        return await service.stop_all()

    assert run(scenario()) == ["a"]
