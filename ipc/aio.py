"""Small asyncio helpers shared by the protocol library and the daemons.

``within`` replaces ``asyncio.wait_for``. On Python 3.11 (Debian bookworm's) ``wait_for`` loses
a cancellation of its caller when the awaited operation completes in the same loop iteration: it
returns the result, and the caller's task goes on as if it had never been cancelled. A task that
is cancelled and then awaited (an event consumer being stopped) can then wait forever.
``asyncio.timeout`` does not have that race, so every time limit goes through it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` after ``timeout`` seconds (None: no limit).

    On a timeout ``aw`` is cancelled, as with ``asyncio.wait_for``; a cancellation of the caller
    always propagates, whatever ``aw`` did meanwhile.
    """
    async with asyncio.timeout(timeout):
        return await aw


async def cancel_and_wait(task: asyncio.Task[object], grace: float = 5.0) -> bool:
    """Cancel ``task`` and wait until it has ended; True if it ended within ``grace`` seconds.

    The cancellation is repeated while the task is still running (a task may absorb one), so a
    caller is never stuck behind a task that does not stop; the caller decides what a False means.
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + grace
    while not task.done():
        remaining = end - loop.time()
        if remaining <= 0:
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(remaining, 0.5))
    return True
