"""The one polling wait of the test suite: ``wait_until(predicate, timeout)``.

Tests never sleep for a fixed time: they poll a condition with a bound, or wait on an event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

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
    if timeout < 0 or interval <= 0:
        raise ValueError(f"wait_until: bad timeout={timeout!r} / interval={interval!r}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"wait_until: {what} still false after {timeout:g}s (last value {value!r})")
        time.sleep(min(interval, deadline - now))
