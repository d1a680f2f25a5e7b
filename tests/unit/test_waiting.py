"""The suite's polling waits (tests/support/waiting.py): ``wait_until`` and its coroutine
counterpart ``eventually`` return the first truthy value, stop at their bound with a
``TimeoutError`` that says what was awaited, and let a probe's own error through at once."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.aio import run
from tests.support.waiting import eventually, wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and n, timeout=10, interval=0.001) == 3


def test_wait_until_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="the door open"):
        wait_until(lambda: False, timeout=0.05, interval=0.01, message="the door open")


def test_eventually_awaits_a_coroutine_probe_and_lets_other_tasks_run() -> None:
    async def scenario() -> str:
        ready = asyncio.Event()
        asyncio.get_running_loop().call_later(0.02, ready.set)  # only runs while eventually sleeps

        async def probe() -> str | None:
            return "ready" if ready.is_set() else None

        return await eventually(probe, timeout=10, interval=0.005)

    assert run(scenario()) == "ready"


def test_eventually_takes_a_plain_function_too() -> None:
    calls = itertools.count(1)
    assert run(eventually(lambda: next(calls) == 2, timeout=10, interval=0.001)) is True


def test_eventually_times_out_naming_what_it_waited_for() -> None:
    async def never() -> int:
        return 0

    with pytest.raises(TimeoutError, match=r"the turn's end still false after 0.05s \(last value 0\)"):
        run(eventually(never, timeout=0.05, interval=0.01, message="the turn's end"))


def test_a_probe_error_propagates_at_once() -> None:
    async def broken() -> bool:
        raise LookupError("no such instance")

    with pytest.raises(LookupError, match="no such instance"):
        run(eventually(broken, timeout=10))


@pytest.mark.parametrize(("timeout", "interval"), [(-1.0, 0.05), (1.0, 0.0)])
def test_bad_bounds_are_refused(timeout: float, interval: float) -> None:
    with pytest.raises(ValueError, match="bad timeout"):
        wait_until(lambda: True, timeout, interval)
    with pytest.raises(ValueError, match="bad timeout"):
        run(eventually(lambda: True, timeout, interval))
