"""Unit tests for ipc.aio: time limits that never lose the caller's cancellation.

Python 3.11's ``asyncio.wait_for`` returns the result when the awaited operation completes in the
same loop iteration as the caller's cancellation, so the cancelled task runs on. That once left a
context reset waiting forever for an event consumer that had swallowed its cancellation inside an
``ack_events`` call (Issue 5). These tests make that exact interleaving deterministic.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import Any

import pytest

from ipc.aio import cancel_and_wait, within
from ipc.client import AsyncClient
from tests.support.aio import run
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(30)


async def _complete_and_cancel(waiting: asyncio.Task[Any], fut: asyncio.Future[Any]) -> Any:
    """Resolve what ``waiting`` awaits and cancel ``waiting`` in the same loop iteration."""
    fut.set_result("reply")
    waiting.cancel()
    return await asyncio.gather(waiting, return_exceptions=True)


def test_within_propagates_a_cancellation_that_races_the_result():
    async def scenario() -> Any:
        fut = asyncio.get_running_loop().create_future()
        went_on = asyncio.Event()

        async def caller() -> None:
            await within(fut, 10)
            went_on.set()  # what a swallowed cancellation would let happen
            await asyncio.sleep(3600)

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)
        (outcome,) = await _complete_and_cancel(task, fut)
        return outcome, went_on.is_set()

    outcome, went_on = run(scenario())
    assert isinstance(outcome, asyncio.CancelledError) and not went_on


def test_within_times_out_and_cancels_what_it_awaited():
    async def scenario() -> tuple[bool, bool]:
        inner = asyncio.create_task(asyncio.sleep(3600))
        with pytest.raises(TimeoutError):
            await within(inner, 0.01)
        await asyncio.sleep(0)
        return inner.cancelled(), (await within(asyncio.sleep(0, "ok"), None)) == "ok"

    assert run(scenario()) == (True, True)


def test_a_client_call_cancelled_as_its_reply_arrives_is_cancelled():
    """The consumer's ack calls go through AsyncClient.call with a time limit: a cancellation that
    arrives together with the reply must still cancel the caller."""

    async def scenario() -> Any:
        with tempfile.TemporaryDirectory(prefix="kd-aio-", dir="/var/tmp") as d:
            path = os.path.join(d, "s.sock")
            server = await asyncio.start_unix_server(lambda r, w: None, path)  # reads nothing, answers nothing
            client = await AsyncClient.connect(path, hello=False)
            try:
                task = asyncio.create_task(client.call("ack_events", {"seq": 1}, timeout=10))
                # the request is on the wire, its reply awaited
                await eventually(lambda: client._pending, 10, interval=0.001, message="the request pending")
                (fut,) = client._pending.values()
                (outcome,) = await _complete_and_cancel(task, fut)
                return outcome
            finally:
                await client.close()
                server.close()

    assert isinstance(run(scenario()), asyncio.CancelledError)


def test_cancel_and_wait_repeats_the_cancellation_until_the_task_ends():
    async def scenario() -> tuple[bool, int]:
        absorbed = 0

        async def stubborn() -> None:
            nonlocal absorbed
            while absorbed < 2:  # absorbs two cancellations, then lets the third end it
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    absorbed += 1
            await asyncio.sleep(3600)

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        return await cancel_and_wait(task, grace=5), absorbed

    assert run(scenario()) == (True, 2)


def test_cancel_and_wait_gives_up_after_the_grace_period():
    async def scenario() -> tuple[bool, bool]:
        deafness = asyncio.Event()
        deafness.set()

        async def deaf() -> None:
            while deafness.is_set():
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    continue

        task = asyncio.create_task(deaf())
        await asyncio.sleep(0)
        gave_up = not await cancel_and_wait(task, grace=0.2)
        deafness.clear()  # now the next cancellation ends it (the test leaves nothing behind)
        return gave_up, await cancel_and_wait(task, grace=5)

    assert run(scenario()) == (True, True)
