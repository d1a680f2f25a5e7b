"""PostgreSQL notifications of a cluster backend (Issue 47): what it listens to, and the transcript
changes it announces.

``NotifyListener`` holds one connection of its own, outside the store's pool, that LISTENs on
``kandev_requests`` (a request for some host was written), ``kandev_results`` (a request was
answered) and ``kandev_transcript`` (a session's transcript or turns changed), in a thread that
blocks in psycopg's ``notifies()`` and hands each notification to the event loop. A dropped
connection is opened again with backoff (0.5 s doubling to 5 s); after each (re)connection the
``on_connected`` callback runs, so whoever waits re-reads the store once (a notification sent while
the connection was down is lost, the rows are not).

``announce_transcript_commits`` makes every commit of the store that changed a session's transcript
or turns (what wakes the local ``follow`` streams, ``daemon.backend.state.transcript_hub``) also
NOTIFY ``kandev_transcript`` with that session's id, inside the same transaction: PostgreSQL delivers
it when the rows are committed, so a ``follow`` stream on another host that wakes finds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from daemon.backend.cluster.requests import REQUESTS_CHANNEL, RESULTS_CHANNEL, TRANSCRIPT_CHANNEL
from daemon.store.db import Store
from daemon.store.transcript import TOUCHED

log = logging.getLogger(__name__)

CHANNELS = (REQUESTS_CHANNEL, RESULTS_CHANNEL, TRANSCRIPT_CHANNEL)
STOP_CHECK_S = 0.25
"""Seconds the listening thread waits on its socket at most before it looks whether it should stop
(a wait for the socket, not a query: an idle connection costs four wake-ups a second, a stop 0.25 s)."""
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0

OnNotify = Callable[[str, str], None]


class NotifyListener:
    """LISTENs on the cluster's channels in a thread; calls ``on_notify(channel, payload)`` and
    ``on_connected()`` on the event loop (see the module doc)."""

    def __init__(self, engine: Engine, on_notify: OnNotify, on_connected: Callable[[], None]) -> None:
        self._engine = engine
        self._on_notify = on_notify
        self._on_connected = on_connected
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.connected = threading.Event()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kandev-cluster-listen", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, STOP_CHECK_S * 3)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            try:
                self._listen()
                backoff = BACKOFF_FIRST_S
            except Exception as exc:  # a dropped connection, a database restarting
                self.connected.clear()
                log.warning("cluster notifications: %s; connecting again in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _listen(self) -> None:
        raw = self._engine.raw_connection()
        conn: Any = raw.driver_connection
        raw.detach()  # our own connection: the pool never hands it to anyone else
        try:
            conn.rollback()
            conn.autocommit = True
            for channel in CHANNELS:
                conn.execute(f"LISTEN {channel}")
            self.connected.set()
            self._post(self._on_connected)
            while not self._stop.is_set():
                for note in conn.notifies(timeout=STOP_CHECK_S):
                    self._post(self._on_notify, note.channel, note.payload)
                if conn.closed or conn.broken:
                    raise ConnectionError("the notification connection was closed")
        finally:
            self.connected.clear()
            with contextlib.suppress(Exception):
                raw.close()


def _announce(db: Session) -> None:
    if not (db.new or db.dirty or db.deleted or db.info.get(TOUCHED)):
        return
    db.flush()  # what commit would flush: its Turn and TaskSession rows are noted as touched now
    touched = db.info.get(TOUCHED)
    for session_id in sorted(touched or ()):
        db.execute(select(func.pg_notify(TRANSCRIPT_CHANNEL, session_id)))


def announce_transcript_commits(store: Store) -> None:
    """NOTIFY ``kandev_transcript`` with every session a commit of ``store`` changed (PostgreSQL)."""
    if store.engine.dialect.name == "postgresql":
        event.listen(store.session_factory, "before_commit", _announce)
