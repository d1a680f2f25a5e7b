"""A full disk is an event, not a loss (Issue 21 item 5): recognising it and watching for space.

``is_out_of_space(exc)`` says whether a failed store write failed for want of space: SQLite's
``SQLITE_FULL``, an SQLite I/O error on a filesystem with (almost) no free bytes (growing the
write-ahead log's index fails as ``SQLITE_IOERR_SHMSIZE``), PostgreSQL's ``disk_full`` (SQLSTATE
53100), or an ``OSError`` with ``ENOSPC``. A failed SQLite or PostgreSQL transaction is rolled
back whole, so nothing is half-applied.

``SpaceWatch`` holds the backend's view: out of space since when, on which path, with how many
free bytes; it emits the journal events (``store_out_of_space`` once when it starts,
``store_space_back`` when a write succeeds again) and lets writers wait until free space
reappears (``wait_for_space``), polling ``statvfs`` every ``POLL_S`` seconds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.core.journal import log_event

log = logging.getLogger(__name__)

POLL_S = 1.0
"""Seconds between free-space checks while out of space."""
RETRY_S = 15.0
"""Seconds after which a waiting writer tries again even if the free bytes did not grow."""
LOW_BYTES = 256 * 1024
"""Free bytes below which an SQLite I/O error counts as the disk being full."""
ROOM_BYTES = 1024 * 1024
"""Free bytes (more than at the failure) after which writers try again at once."""


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (None if unknown)."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None


def is_out_of_space(exc: BaseException, path: Path | None) -> bool:
    """Whether ``exc`` (a failed store write, or any OSError) means the disk is full."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        name = getattr(current, "sqlite_errorname", None)
        if name == "SQLITE_FULL":
            return True
        if isinstance(name, str) and name.startswith("SQLITE_IOERR") and path is not None:
            free = free_bytes(path)
            if free is not None and free < LOW_BYTES:
                return True
        if getattr(current, "pgcode", None) == "53100" or getattr(current, "sqlstate", None) == "53100":
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


@dataclass
class OutOfSpace:
    path: str
    free_bytes: int | None
    since: float  # wall clock, for people
    detail: str
    began: float = field(default_factory=time.monotonic)  # what its duration is measured from


class SpaceWatch:
    """Whether the store (or the home) is out of space, as the backend last found it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path  # the store's file (None: not a file, e.g. PostgreSQL)
        self.state: OutOfSpace | None = None
        self.episodes = 0

    @property
    def out_of_space(self) -> bool:
        return self.state is not None

    def failed(self, exc: BaseException) -> bool:
        """Note a failed write; True (and the event reported) if it failed for want of space."""
        if not is_out_of_space(exc, self.path):
            return False
        free = free_bytes(self.path) if self.path is not None else None
        if self.state is None:
            where = str(self.path) if self.path is not None else "database.url"
            self.state = OutOfSpace(where, free, time.time(), f"{type(exc).__name__}: {exc}"[:300])
            self.episodes += 1
            log_event("store_out_of_space",
                      f"the store at {where} is out of space ({free} bytes free): events are not acknowledged"
                      " and stay with the control server, which pauses agents at their bound; the backend"
                      " catches up once space is back", priority=3, PATH=where, FREE_BYTES=free)
        else:
            self.state.free_bytes = free
        return True

    def succeeded(self) -> None:
        """A store write succeeded: if it was out of space, it is not any more."""
        if self.state is None:
            return
        state, self.state = self.state, None
        free = free_bytes(self.path) if self.path is not None else None
        log_event("store_space_back", f"the store at {state.path} takes writes again ({free} bytes free)",
                  PATH=state.path, FREE_BYTES=free, OUT_OF_SPACE_S=int(time.monotonic() - state.began))

    async def wait_for_space(self) -> None:
        """Until free space grew by ``ROOM_BYTES`` since the failure (or ``RETRY_S`` passed): then
        a writer tries again. Returns at once when not out of space."""
        state = self.state
        if state is None:
            return
        start = time.monotonic()
        base = state.free_bytes or 0
        while self.state is state and time.monotonic() - start < RETRY_S:
            free = free_bytes(self.path) if self.path is not None else None
            if free is not None:
                state.free_bytes = free
                if free >= base + ROOM_BYTES:
                    return
            await asyncio.sleep(POLL_S)

    def status(self) -> dict[str, Any] | None:
        """``kandev status``'s ``store.out_of_space`` (None when writes go through)."""
        s = self.state
        if s is None:
            return None
        return {"path": s.path, "free_bytes": s.free_bytes, "since": s.since, "detail": s.detail}
