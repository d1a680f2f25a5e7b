"""The event loop the daemons run on: uvloop when it is installed, asyncio's own otherwise.

Measured with tests/bench/bench_ipc.py, the asyncio event loop (its selector, callback
scheduling and transports, all in Python) is the largest part of an ``ipc`` round trip after
the two context switches every Unix-socket round trip pays; uvloop (libuv, in C) does the same
work for about two thirds of the time. Everything in ``ipc`` and the daemons uses only the
asyncio API, so both loops run the same code: uvloop is an accelerator, never a requirement.
``KANDEV_EVENT_LOOP=asyncio`` in the environment forces asyncio's loop (to rule the accelerator
out when chasing a bug).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "KANDEV_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """``uvloop.new_event_loop`` when uvloop is importable and not switched off, else asyncio's."""
    if os.environ.get(ENV, "").strip().lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop runs (for a start-up log line)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the kind ``run`` uses."""
    return loop_factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
