"""Wake-ups for ``follow`` streams: which sessions' transcripts or turns just changed in the store.

A ``follow`` stream (``daemon.backend.views.follow``) sends what the store holds and then sleeps until
its session changes. It learns that here, not by polling: the hub listens to the store's
SQLAlchemy sessions, notes every ``Turn`` and ``TaskSession`` row a flush writes and every session
whose transcript a ``daemon.store.transcript`` writer touched, and once that transaction commits wakes the streams watching those sessions. So whoever writes
(the event consumer applying a batch, a permission answer, recovery, resume) wakes the followers,
and a follower woken after a commit always finds the rows of that commit.

Commits may happen on the event loop or in worker threads (``asyncio.to_thread``); the hub only
touches its state on the loop (``call_soon_threadsafe`` from other threads). Sessions nobody
follows cost one dictionary lookup per commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from daemon.store.db import Store
from daemon.store.models import TaskSession, Turn
from daemon.store.transcript import TOUCHED as _TOUCHED
from ipc.aio import within


class Watch:
    """One session's change counter, shared by everyone following it."""

    def __init__(self) -> None:
        self.version = 0
        self.followers = 0
        self._changed = asyncio.Event()

    def bump(self) -> None:
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, seen: int, timeout: float) -> bool:
        """Until the version differs from ``seen`` (True) or ``timeout`` seconds pass (False)."""
        if self.version != seen:
            return True
        try:
            await within(self._changed.wait(), timeout)
        except TimeoutError:
            return self.version != seen
        return True


class TranscriptHub:
    """Per-session change notifications fed by store commits (see the module doc)."""

    def __init__(self) -> None:
        self._watches: dict[str, Watch] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def observe(self, store: Store) -> None:
        """Listen to the commits of ``store``'s sessions."""
        factory = store.session_factory
        event.listen(factory, "after_flush", self._after_flush)
        event.listen(factory, "after_commit", self._after_commit)
        event.listen(factory, "after_rollback", self._forget)
        event.listen(factory, "after_soft_rollback", self._after_soft_rollback)

    @contextlib.asynccontextmanager
    async def watching(self, session_id: str) -> AsyncIterator[Watch]:
        """The session's ``Watch`` while the block runs (register before the first read)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        watch = self._watches.get(session_id)
        if watch is None:
            watch = self._watches[session_id] = Watch()
        watch.followers += 1
        try:
            yield watch
        finally:
            watch.followers -= 1
            if watch.followers == 0 and self._watches.get(session_id) is watch:
                del self._watches[session_id]

    def watched(self) -> list[str]:
        """The sessions someone follows now."""
        return list(self._watches)

    def notify(self, session_ids: Iterable[str]) -> None:
        """Wake the followers of these sessions (any thread)."""
        loop = self._loop
        if loop is None:
            return  # nobody has ever followed anything
        ids = list(session_ids)
        if threading.get_ident() == self._loop_thread:
            self._wake(ids)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to wake
            loop.call_soon_threadsafe(self._wake, ids)

    def _wake(self, session_ids: list[str]) -> None:
        for session_id in session_ids:
            watch = self._watches.get(session_id)
            if watch is not None:
                watch.bump()

    # -- SQLAlchemy session events ---------------------------------------------

    @staticmethod
    def _after_flush(db: Session, _context: Any) -> None:
        touched: set[str] | None = None
        for obj in (*db.new, *db.dirty, *db.deleted):
            if isinstance(obj, Turn):
                sid = obj.session_id
            elif isinstance(obj, TaskSession):
                sid = obj.id
            else:
                continue
            if sid is not None:
                if touched is None:
                    touched = db.info.setdefault(_TOUCHED, set())
                touched.add(sid)

    def _after_commit(self, db: Session) -> None:
        touched = db.info.pop(_TOUCHED, None)
        if touched:
            self.notify(touched)

    @staticmethod
    def _forget(db: Session) -> None:
        db.info.pop(_TOUCHED, None)

    @staticmethod
    def _after_soft_rollback(db: Session, _previous: Any) -> None:
        db.info.pop(_TOUCHED, None)
