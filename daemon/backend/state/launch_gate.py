"""The gate between session launches and a replacement of the control server.

A launch (``create_instance`` and what must stay with it) holds the gate shared; replacing the
control server (``daemon.backend.lifetime.server_upgrade``) takes it alone: it waits for launches in flight
and holds new ones back, so no agent is started on a server about to be retired.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["LaunchGate"]


class LaunchGate:
    """Launches (``create_instance`` and what must stay with it) share the gate; a replacement of
    the control server takes it alone: it waits for launches in flight and holds new ones back."""

    def __init__(self) -> None:
        self._launches = 0
        self._exclusive = False
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def launch(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive)
            self._launches += 1
        try:
            yield
        finally:
            async with self._changed:
                self._launches -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            await self._changed.wait_for(lambda: self._launches == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()
