"""The one way a synchronous test runs asynchronous code: ``run(coro, timeout)``.

Each call gets a fresh event loop (``asyncio.run``) and an outer bound, so a scenario that hangs
fails with ``TimeoutError`` and a traceback instead of running into pytest-timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

SCENARIO_TIMEOUT = 120.0  # seconds; the outer bound of one scenario unless the caller gives another


def run(coro: Awaitable[T], timeout: float = SCENARIO_TIMEOUT) -> T:
    """Run one test scenario on a fresh loop, bounded by ``timeout`` seconds."""

    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())
