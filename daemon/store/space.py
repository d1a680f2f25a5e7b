"""A full disk is an event, not a loss (Issue 21 item 5), and it is seen (Issue 45 item 3).

``is_out_of_space(exc)`` says whether a failed store write failed for want of space: SQLite's
``SQLITE_FULL``, an SQLite I/O error on a filesystem with (almost) no free bytes (growing the
write-ahead log's index fails as ``SQLITE_IOERR_SHMSIZE``), PostgreSQL's ``disk_full`` (SQLSTATE
53100), or an ``OSError`` with ``ENOSPC``. A failed SQLite or PostgreSQL transaction is rolled
back whole, so nothing is half-applied.

``SpaceWatch`` holds the backend's view: out of space since when, on which path, with how many
free bytes, and why (``cause``): a store write failed (``write_failed``), or the free space
itself ran out (``no_free_space``). A failed write alone is not enough to see a full disk: while
a turn streams, the agent writes into the home too (its own session files), and when that write
finds no space the agent waits, its stream stops and the backend has nothing left to write, so
no store write ever fails (Issue 45 scenario C). So ``check_free()`` (called every second by the
store's upkeep) also looks at the free space of the store's and the home's filesystems, as an
unprivileged writer sees it (``f_bavail``: the agents are never root, and ext4 keeps blocks for
root alone): below ``LOW_BYTES`` on either is out of space.

It emits the journal events (``store_out_of_space`` once when an episode starts,
``store_space_back`` when it ends: a write succeeded and every watched filesystem has room again,
``CLEAR_BYTES`` when the episode began for want of free space, so a filesystem hovering at the
bound does not flap) and lets writers wait until free space reappears (``wait_for_space``),
polling ``statvfs`` every ``POLL_S`` seconds.
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
CLEAR_BYTES = LOW_BYTES + ROOM_BYTES
"""Free bytes every watched filesystem needs before an episode that began for want of free space ends."""
WRITE_FAILED = "write_failed"
NO_FREE_SPACE = "no_free_space"


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
    cause: str = WRITE_FAILED  # or NO_FREE_SPACE
    began: float = field(default_factory=time.monotonic)  # what its duration is measured from


class SpaceWatch:
    """Whether the store (or the home) is out of space, as the backend last found it."""

    def __init__(self, path: Path | None, home: Path | None = None) -> None:
        self.path = path  # the store's file (None: not a file, e.g. PostgreSQL)
        # the filesystems whose free space is watched: the store's, and the home's (the agents'
        # session files), once each
        self.watched = list(dict.fromkeys(p for p in (path, home) if p is not None))
        self.state: OutOfSpace | None = None
        self.episodes = 0

    @property
    def out_of_space(self) -> bool:
        return self.state is not None

    def _begin(self, where: str, free: int | None, detail: str, cause: str) -> None:
        self.state = OutOfSpace(where, free, time.time(), detail[:300], cause)
        self.episodes += 1
        if cause == WRITE_FAILED:
            what = ("a store write failed: events are not acknowledged and stay with the control server,"
                    " which pauses agents at their bound")
        else:
            what = ("agents' writes there wait for space, so their turns stall; the store stops taking"
                    " events once it needs more space (they then wait with the control server)")
        log_event("store_out_of_space", f"{where} is out of space ({free} bytes free): {what}; everything goes"
                  " on once space is back", priority=3, PATH=where, FREE_BYTES=free, CAUSE=cause)

    def _short(self) -> tuple[Path, int] | None:
        """The first watched filesystem with too little free space to end the episode (and its free bytes)."""
        need = CLEAR_BYTES if self.state is not None and self.state.cause == NO_FREE_SPACE else LOW_BYTES
        for p in self.watched:
            free = free_bytes(p)
            if free is not None and free < need:
                return p, free
        return None

    def failed(self, exc: BaseException) -> bool:
        """Note a failed write; True (and the event reported) if it failed for want of space."""
        if not is_out_of_space(exc, self.path):
            return False
        free = free_bytes(self.path) if self.path is not None else None
        if self.state is None:
            where = str(self.path) if self.path is not None else "database.url"
            self._begin(where, free, f"{type(exc).__name__}: {exc}", WRITE_FAILED)
        else:
            self.state.free_bytes = free
        return True

    def check_free(self) -> bool:
        """Look at the watched filesystems' free space: less than ``LOW_BYTES`` on one starts an
        episode (no write needs to fail for it). True while out of space."""
        for p in self.watched:
            free = free_bytes(p)
            if free is None or free >= LOW_BYTES:
                continue
            if self.state is None:
                self._begin(str(p), free, f"{free} bytes free on the filesystem of {p} (less than {LOW_BYTES})",
                            NO_FREE_SPACE)
            elif self.state.path == str(p):
                self.state.free_bytes = free
            return True
        return self.state is not None

    def succeeded(self) -> None:
        """A store write succeeded: if it was out of space, it is not any more, unless a watched
        filesystem is still (nearly) full."""
        if self.state is None:
            return
        short = self._short()
        if short is not None:
            if self.state.path == str(short[0]):
                self.state.free_bytes = short[1]
            return
        state, self.state = self.state, None
        free = free_bytes(Path(state.path)) if state.path != "database.url" else None
        log_event("store_space_back", f"{state.path} takes writes again ({free} bytes free)",
                  PATH=state.path, FREE_BYTES=free, OUT_OF_SPACE_S=int(time.monotonic() - state.began))

    async def wait_for_space(self) -> None:
        """Until free space grew by ``ROOM_BYTES`` since the failure (an episode for want of free
        space: until it reached ``CLEAR_BYTES``), or ``RETRY_S`` passed: then a writer tries again.
        Returns at once when not out of space."""
        state = self.state
        if state is None:
            return
        start = time.monotonic()
        target = (state.free_bytes or 0) + ROOM_BYTES if state.cause == WRITE_FAILED else CLEAR_BYTES
        where = Path(state.path) if state.path != "database.url" else None
        while self.state is state and time.monotonic() - start < RETRY_S:
            free = free_bytes(where) if where is not None else None
            if free is not None:
                state.free_bytes = free
                if free >= target:
                    return
            await asyncio.sleep(POLL_S)

    def status(self) -> dict[str, Any] | None:
        """``kandev status``'s ``store.out_of_space`` (None when writes go through)."""
        s = self.state
        if s is None:
            return None
        return {"path": s.path, "free_bytes": s.free_bytes, "since": s.since, "detail": s.detail, "cause": s.cause}
