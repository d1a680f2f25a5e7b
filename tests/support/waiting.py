"""The one polling wait of the test suite: ``wait_until(predicate, timeout)``, and
``eventually(probe, timeout)``, the same wait for a coroutine on a running event loop.

Tests never sleep for a fixed time: they poll a condition with a bound, or wait on an event.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value.

    Bounded: raises ``TimeoutError`` after ``timeout`` seconds (the predicate is tried one
    last time at the deadline). Exceptions raised by the predicate propagate at once.
    """
    bound = _Bound("wait_until", timeout, interval, message or getattr(predicate, "__name__", repr(predicate)))
    while True:
        value = predicate()
        if value:
            return value
        time.sleep(bound.pause(value))


async def eventually(
    probe: Callable[[], Awaitable[T] | T],
    timeout: float,
    interval: float = 0.05,
    message: str | None = None,
) -> T:
    """``wait_until`` inside a coroutine: call ``probe()`` (a plain function, or a coroutine
    function whose awaitable is awaited, e.g. a call to a server) until it returns something
    truthy and return that value, sleeping ``interval`` on the loop in between so that the
    other tasks run.

    Bounded: raises ``TimeoutError`` after ``timeout`` seconds (the probe is tried one last
    time at the deadline). Exceptions raised by the probe propagate at once.
    """
    bound = _Bound("eventually", timeout, interval, message or getattr(probe, "__name__", repr(probe)))
    while True:
        result = probe()
        value = cast(T, await result) if inspect.isawaitable(result) else cast(T, result)
        if value:
            return value
        await asyncio.sleep(bound.pause(value))


class _Bound:
    """The deadline of one wait: how long to pause before the next try, or the timeout."""

    def __init__(self, who: str, timeout: float, interval: float, what: str) -> None:
        if timeout < 0 or interval <= 0:
            raise ValueError(f"{who}: bad timeout={timeout!r} / interval={interval!r}")
        self.who, self.timeout, self.interval, self.what = who, timeout, interval, what
        self.deadline = time.monotonic() + timeout

    def pause(self, last_value: object) -> float:
        """Seconds to wait before the next try; ``TimeoutError`` once the deadline has passed."""
        now = time.monotonic()
        if now >= self.deadline:
            raise TimeoutError(f"{self.who}: {self.what} still false after {self.timeout:g}s (last value {last_value!r})")
        return min(self.interval, self.deadline - now)
