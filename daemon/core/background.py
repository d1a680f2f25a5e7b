"""One named background loop of a daemon: started on the running event loop, cancelled and awaited on stop.

The backend's upkeep loops (store care, the turn watch, ...) each own one. ``stop`` never raises:
a loop that already failed has logged its own error, and shutting down must go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundLoop:
    """``run`` is the loop's coroutine function; ``name`` names its asyncio task (task dumps show it)."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self.running:
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
