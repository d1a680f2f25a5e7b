"""The turn watch: what the backend does about a running turn whose agent went silent (Issue 46 Why 5).

``daemon.backend.state.quiet_turns`` measures each running turn's silence; this task sleeps until the
next warning level or timeout is due (a new turn wakes it sooner; an idle backend looks once a
minute), reads it and acts:

- a turn silent for ``agents.quiet_warning_s`` (and again at each multiple): the follow streams of
  its session are woken, and send ``quiet`` (``daemon.backend.views.follow``); the first time in a
  silence the journal says so too. The board and ``session show`` read the silence when asked.
- a turn silent for ``agents.turn_timeout_s`` (when not 0): the store marks it timed out and its
  transcript says why (``daemon.backend.state.events.mark_timed_out``), then it is cancelled through
  the one cancel path (``SessionService.cancel``, what ``kandev cancel`` does). The agent answers the
  cancel with ``cancelled``, which the store keeps as stop reason ``timeout``. An agent that does
  not answer a cancel at all keeps its turn open: the silence goes on being reported (``timed_out``)
  until its agent is stopped; nothing here stops an agent.

A session this backend no longer tracks is forgotten. Blocking store work runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.backend.state.events import mark_timed_out
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.state.quiet_turns import Quiet, QuietTurns
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.core.background import BackgroundLoop
from daemon.core.journal import log_event
from daemon.store.db import Store
from ipc.aio import within
from ipc.errors import IpcError

log = logging.getLogger(__name__)

IDLE_S = 60.0
"""The longest the watch sleeps between two looks; it sleeps until the next warning or timeout is
due, and a new turn (or an answered permission request) wakes it sooner."""
TICK_MIN_S = 0.05


class TurnWatch:
    """Warns about and times out silent turns (see the module doc)."""

    def __init__(self, quiet: QuietTurns, executions: ExecutionStore, store: Store, hub: TranscriptHub,
                 cancel: Callable[[str], Awaitable[Any]], timeout_s: int) -> None:
        self.quiet = quiet
        self.executions = executions
        self.store = store
        self.hub = hub
        self.cancel = cancel  # SessionService.cancel
        self.timeout_s = timeout_s
        self._loop = BackgroundLoop("turn-watch", self._run)
        self._wake = asyncio.Event()
        quiet.on_sooner = self._wake.set

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the turn watch failed; it goes on")
            soon = self.quiet.next_change()
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), IDLE_S if soon is None else min(IDLE_S, max(TICK_MIN_S, soon)))

    async def tick(self) -> None:
        """One look: wake the followers of turns that grew quieter, end those silent for too long."""
        for q in self.quiet.crossed():
            if self._tracked(q):
                self.hub.notify([q.session_id])
                if q.level == 1:
                    log_event("turn_quiet", f"session {q.session_id}: no output from its agent for {q.seconds} s",
                              SESSION_ID=q.session_id, TURN_ID=q.turn_id, QUIET_S=q.seconds)
        for q in self.quiet.due():
            if self._tracked(q):
                await self._time_out(q)

    def _tracked(self, q: Quiet) -> bool:
        if q.session_id in self.executions.executions:
            return True
        self.quiet.forget(q.session_id)
        return False

    def _mark(self, q: Quiet) -> bool:
        with self.store.session() as db:
            return mark_timed_out(db, q.session_id, q.turn_id, seconds=q.seconds, limit=self.timeout_s)

    async def _time_out(self, q: Quiet) -> None:
        if not await asyncio.to_thread(self._mark, q):
            return  # it ended meanwhile
        log_event("turn_timeout", f"session {q.session_id}: turn {q.turn_id} cancelled after {q.seconds} s"
                  f" without output from its agent (agents.turn_timeout_s = {self.timeout_s})",
                  SESSION_ID=q.session_id, TURN_ID=q.turn_id, QUIET_S=q.seconds)
        try:
            await self.cancel(q.session_id)
        except IpcError as exc:
            log.warning("session %s: cancelling its silent turn %s failed: %s", q.session_id, q.turn_id, exc.message)
