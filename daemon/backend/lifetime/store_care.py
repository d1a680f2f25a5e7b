"""The store's upkeep while the backend runs: its size, free space, transcript retention, vacuum.

- Space (Issue 21 item 5, Issue 45 item 3): ``space`` (``daemon.store.space.SpaceWatch``) is what
  every writer that can fail for want of space reports to (the event consumer, ``kandev`` ops);
  every second the upkeep also looks at the free space of the store's and the home's filesystems
  (``SpaceWatch.check_free``), since an agent that finds the home full stalls its turn without any
  store write failing. While it says out of space, a probe writes one row each time free space
  grows (or every ``RETRY_S``) so the warning clears even when no agent is streaming; the
  consumers retry on their own.
- Reach (Issue 47 item 5): ``reach`` (``daemon.store.reach.ReachWatch``) is what every store user
  reports a failure to reach the database server to. While it says unreachable, the upkeep probes
  with one small write, at once and then after a growing delay (``daemon.store.reach.next_delay``:
  0.25 s doubling to 2 s) until one commits, which ends the episode and wakes the event consumers; nothing else
  touches the store meanwhile. On PostgreSQL the upkeep also probes every ``REACH_EVERY_S`` while
  all is well, so that an outage shows in ``kandev status`` and the journal even when no agent
  streams and nobody calls; after each probe that reached it, ``keep_lock`` runs (the store's
  PostgreSQL lock is taken again if the server dropped it with its connection).
- Retention (Issue 24 item 2): with ``store.transcript_retention`` set, entries older than it are
  removed at start and then every ``RETENTION_EVERY_S``. The freed pages are reused by later
  writes; ``vacuum()`` (``kandev store vacuum``) gives them back to the filesystem.
- ``status()`` is ``kandev status``'s ``store`` part: where, how many bytes, out of space or not.

Blocking database work runs in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from daemon.core.background import BackgroundLoop
from daemon.core.journal import log_event
from daemon.store import transcript
from daemon.store.db import Store, sqlite_file
from daemon.store.models import Installation
from daemon.store.reach import ReachWatch, next_delay
from daemon.store.space import LOW_BYTES, SpaceWatch, free_bytes

log = logging.getLogger(__name__)

RETENTION_EVERY_S = 3600.0
REACH_EVERY_S = 5.0
"""Seconds between two probes of a database server (not a file) while it answers."""
_PROBE_KEY = "space_probe"


def sqlite_bytes(path: Path) -> int:
    """The bytes an SQLite store takes: the database file and its write-ahead log and index."""
    total = 0
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(OSError):
            total += (path.parent / (path.name + suffix)).stat().st_size
    return total


def probe_write(store: Store, *, need_room: bool = False) -> bool:
    """One small committed write (the time of this probe): raises if the store takes no writes.
    ``need_room``: also raise ``ENOSPC`` when an SQLite store's filesystem has less than
    ``LOW_BYTES`` free (at start: SQLite may still write into a log it allocated earlier, but
    recovery and the agents' backlog would not fit)."""
    path = sqlite_file(make_url(store.engine.url))
    if need_room and path is not None:
        free = free_bytes(path)
        if free is not None and free < LOW_BYTES:
            raise OSError(errno.ENOSPC, f"{free} bytes free on the store's filesystem", str(path))
    with store.session() as db:
        row = db.get(Installation, _PROBE_KEY)
        stamp = datetime.now(UTC).isoformat()
        if row is None:
            db.add(Installation(key=_PROBE_KEY, value=stamp))
        else:
            row.value = stamp
    return True


def ping(store: Store) -> None:
    """One round trip to the database server (a pooled connection is checked first, and replaced
    if the server ended it): raises if the server cannot be reached."""
    with store.engine.connect() as conn:
        conn.execute(text("SELECT 1"))


class StoreCare:
    """Size, space, retention and vacuum of one backend's store (see the module doc)."""

    def __init__(self, store: Store, retention_s: float | None, home: Path | None = None,
                 keep_lock: Callable[[], bool] | None = None) -> None:
        self.store = store
        self.path = sqlite_file(make_url(store.engine.url))
        self.space = SpaceWatch(self.path, home)
        self.reach = ReachWatch()
        # a database server (not a file): probed now and then even while it answers
        self.remote = store.engine.dialect.name == "postgresql"
        # after a probe reached the server, in a worker thread: True if the lock had to be taken again
        self.keep_lock = keep_lock
        self.lock_lost: str | None = None  # why the lock could not be taken again (said once)
        self.retention_s = retention_s
        self.last_retention: dict[str, Any] | None = None
        self._loop = BackgroundLoop("store-care", self._run)

    # -- size --------------------------------------------------------------------------------

    def size_bytes(self) -> int | None:
        """How many bytes the store takes (None if it cannot be read; a database server that cannot
        be reached is reported to ``reach``)."""
        if self.path is not None:
            return sqlite_bytes(self.path)
        if self.remote and not self.reach.unreachable:
            try:
                with self.store.engine.connect() as conn:
                    return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar() or 0)
            except Exception as exc:
                self.reach.failed(exc)
                return None
        return None

    async def status(self) -> dict[str, Any]:
        size = await asyncio.to_thread(self.size_bytes)
        return {
            **self.reach.status(),
            "path": str(self.path) if self.path is not None else None,
            "bytes": size,
            "free_bytes": free_bytes(self.path) if self.path is not None else None,
            "out_of_space": self.space.status(),
            "transcript_retention_s": self.retention_s,
            "last_retention": self.last_retention,
        }

    # -- the background upkeep ---------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _run(self) -> None:
        next_retention = time.monotonic()
        next_reach = time.monotonic() + REACH_EVERY_S
        while True:
            if self.reach.unreachable:
                await self._reconnect()
                continue
            if self.remote and time.monotonic() >= next_reach:
                try:
                    await asyncio.to_thread(ping, self.store)
                except Exception as exc:
                    if self.reach.failed(exc):
                        continue
                    log.warning("store ping failed: %s", exc)
                else:
                    await self._keep_lock()
                next_reach = time.monotonic() + REACH_EVERY_S
                continue
            if self.space.check_free():
                await self.space.wait_for_space()
                await self._probe()
                continue
            if self.retention_s is not None and time.monotonic() >= next_retention:
                try:
                    await asyncio.to_thread(self.apply_retention)
                    next_retention = time.monotonic() + RETENTION_EVERY_S
                except Exception as exc:
                    if not self.space.failed(exc) and not self.reach.failed(exc):
                        log.exception("transcript retention failed")
                    next_retention = time.monotonic() + 60.0
            await asyncio.sleep(1.0)

    async def _probe(self) -> bool:
        """One small write: if it commits, the store takes writes again (and its server answers)."""
        try:
            await asyncio.to_thread(probe_write, self.store)
        except Exception as exc:
            if self.reach.unreachable:
                self.reach.probe_failed(exc)
            elif not self.space.failed(exc) and not self.reach.failed(exc):
                log.warning("store probe failed: %s", exc)
            return False
        self.space.succeeded()
        if self.reach.unreachable:
            await self._keep_lock()
            self.reach.succeeded()
        return True

    async def _keep_lock(self) -> None:
        """The store's lock, taken again if the server dropped it (``StoreLock.ensure``)."""
        if self.keep_lock is None:
            return
        try:
            if await asyncio.to_thread(self.keep_lock):
                self.lock_lost = None
                log_event("store_lock_retaken", "the database server had dropped the store's lock with its"
                          " connection; it is held again")
        except Exception as exc:
            if not self.reach.failed(exc) and self.lock_lost != str(exc):
                self.lock_lost = str(exc)
                log_event("store_lock_lost", f"the store's lock could not be taken again: {exc}", priority=3,
                          DETAIL=str(exc)[:300])

    async def _reconnect(self) -> None:
        """While the server is unreachable: probe after a growing delay until a probe commits."""
        attempt = 0
        while self.reach.unreachable:
            await asyncio.sleep(next_delay(attempt))
            attempt += 1
            await self._probe()

    # -- retention and vacuum ----------------------------------------------------------------

    def apply_retention(self) -> int:
        """Remove transcript entries older than the retention; returns how many chunks went."""
        if self.retention_s is None:
            return 0
        cutoff = datetime.now(UTC) - timedelta(seconds=self.retention_s)
        with self.store.session() as db:
            gone = transcript.delete_older_than(db, cutoff)
        self.last_retention = {"at": datetime.now(UTC).isoformat(), "chunks_removed": gone,
                               "cutoff": cutoff.isoformat()}
        if gone:
            log_event("transcript_retention", f"transcript retention removed {gone} chunk(s) older than"
                      f" {cutoff.isoformat()}", CHUNKS=gone)
        return gone

    def vacuum(self) -> dict[str, Any]:
        """Give free pages back to the filesystem (``VACUUM``; on SQLite the log is cut back too)."""
        before = self.size_bytes()
        started = time.monotonic()
        with self.store.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("VACUUM")
            if self.path is not None:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        after = self.size_bytes()
        result = {"bytes_before": before, "bytes_after": after,
                  "seconds": round(time.monotonic() - started, 3)}
        log_event("store_vacuumed", f"store vacuumed: {before} -> {after} bytes", BYTES_BEFORE=before,
                  BYTES_AFTER=after)
        return result
