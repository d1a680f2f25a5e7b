"""The store's upkeep while the backend runs: its size, free space, transcript retention, vacuum.

- Space (Issue 21 item 5, Issue 45 item 3): ``space`` (``daemon.store.space.SpaceWatch``) is what
  every writer that can fail for want of space reports to (the event consumer, ``kandev`` ops);
  every second the upkeep also looks at the free space of the store's and the home's filesystems
  (``SpaceWatch.check_free``), since an agent that finds the home full stalls its turn without any
  store write failing. While it says out of space, a probe writes one row each time free space
  grows (or every ``RETRY_S``) so the warning clears even when no agent is streaming; the
  consumers retry on their own.
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
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import make_url

from daemon.core.journal import log_event
from daemon.store import transcript
from daemon.store.db import Store, sqlite_file
from daemon.store.models import Installation
from daemon.store.space import LOW_BYTES, SpaceWatch, free_bytes

log = logging.getLogger(__name__)

RETENTION_EVERY_S = 3600.0
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


class StoreCare:
    """Size, space, retention and vacuum of one backend's store (see the module doc)."""

    def __init__(self, store: Store, retention_s: float | None, home: Path | None = None) -> None:
        self.store = store
        self.path = sqlite_file(make_url(store.engine.url))
        self.space = SpaceWatch(self.path, home)
        self.retention_s = retention_s
        self.last_retention: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- size --------------------------------------------------------------------------------

    def size_bytes(self) -> int | None:
        """How many bytes the store takes (None if it cannot be read)."""
        return self._size()[0]

    def _size(self) -> tuple[int | None, str | None]:
        """The store's size in bytes (None if it cannot be read) and, for a database server that
        cannot be reached, why (the error's type and first line: never the URL or a password)."""
        if self.path is not None:
            return sqlite_bytes(self.path), None
        if self.store.engine.dialect.name == "postgresql":
            try:
                with self.store.engine.connect() as conn:
                    return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar() or 0), None
            except Exception as exc:
                return None, _unreachable(exc)
        return None, None

    async def status(self) -> dict[str, Any]:
        size, unreachable = await asyncio.to_thread(self._size)
        return {
            "path": str(self.path) if self.path is not None else None,
            # a database server that cannot be reached (restarting, a dropped network): why, else None
            "unreachable": unreachable,
            "bytes": size,
            "free_bytes": free_bytes(self.path) if self.path is not None else None,
            "out_of_space": self.space.status(),
            "transcript_retention_s": self.retention_s,
            "last_retention": self.last_retention,
        }

    # -- the background upkeep ---------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="store-care")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        next_retention = time.monotonic()
        while True:
            if self.space.check_free():
                await self.space.wait_for_space()
                await self._probe()
                continue
            if self.retention_s is not None and time.monotonic() >= next_retention:
                try:
                    await asyncio.to_thread(self.apply_retention)
                    next_retention = time.monotonic() + RETENTION_EVERY_S
                except Exception as exc:
                    if not self.space.failed(exc):
                        log.exception("transcript retention failed")
                    next_retention = time.monotonic() + 60.0
            await asyncio.sleep(1.0)

    async def _probe(self) -> None:
        """One small write: if it commits, the store takes writes again."""
        try:
            await asyncio.to_thread(probe_write, self.store)
        except Exception as exc:
            if not self.space.failed(exc):
                log.warning("store probe failed: %s", exc)
            return
        self.space.succeeded()

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


def _unreachable(exc: Exception) -> str:
    """How ``status`` says the database cannot be reached: the driver's first line, without the
    connection's details (psycopg names the socket or host, never the password)."""
    cause = getattr(exc, "orig", None) or exc
    first = (str(cause).strip().splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}" if first else type(cause).__name__
