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
  cancel with ``cancelled``, which the store keeps as stop reason ``timeout``.
- a timed-out turn still open ``agents.turn_timeout_s`` after its cancel (at most ``ANSWER_MAX_S``;
  a wedged agent that ignores ``session/cancel``): its agent is stopped as ``kandev session stop``
  stops one (``stop``: its whole process group, the turn ended with its reason ``timeout``, the
  transcript saying who stopped it and why); ``kandev resume`` gives the session an agent again.

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
from daemon.store.models import Turn
from daemon.store.states import TurnState
from ipc.aio import within
from ipc.errors import IpcError

log = logging.getLogger(__name__)

IDLE_S = 60.0
"""The longest the watch sleeps between two looks; it sleeps until the next warning or timeout is
due, and a new turn (or an answered permission request) wakes it sooner."""
TICK_MIN_S = 0.05
ANSWER_MAX_S = 300
"""The longest an agent has to answer the cancel of its timed-out turn before it is stopped."""


class TurnWatch:
    """Warns about and times out silent turns (see the module doc)."""

    def __init__(self, quiet: QuietTurns, executions: ExecutionStore, store: Store, hub: TranscriptHub,
                 cancel: Callable[[str], Awaitable[Any]], timeout_s: int,
                 stop: Callable[[str, str], Awaitable[Any]] | None = None) -> None:
        self.quiet = quiet
        self.executions = executions
        self.store = store
        self.hub = hub
        self.cancel = cancel  # SessionService.cancel
        self.stop_agent = stop  # lifecycle.stop_session(session_id, by=...)
        self.timeout_s = timeout_s
        self.answer_s = float(min(timeout_s, ANSWER_MAX_S))  # for the cancel of a timed-out turn
        self.clock = quiet.clock  # the silences' clock: a cancel's answer is due on the same one
        self._cancelled: dict[str, tuple[str, float]] = {}  # session -> (its timed-out turn, stop after)
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
            if self._cancelled:
                stop_in = min(due for _, due in self._cancelled.values()) - self.clock()
                soon = stop_in if soon is None else min(soon, stop_in)
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
        now = self.clock()
        for session_id, (turn_id, due) in list(self._cancelled.items()):
            if session_id not in self.executions.executions:
                del self._cancelled[session_id]  # stopped, exited or no longer ours
            elif due <= now:
                del self._cancelled[session_id]
                await self._stop_unanswered(session_id, turn_id)

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
        if self.stop_agent is not None:
            self._cancelled[q.session_id] = (q.turn_id, self.clock() + self.answer_s)

    def _still_open(self, session_id: str, turn_id: str) -> bool:
        with self.store.session() as db:
            turn = db.get(Turn, turn_id)
            return turn is not None and turn.session_id == session_id and turn.state == TurnState.OPEN

    async def _stop_unanswered(self, session_id: str, turn_id: str) -> None:
        """The agent left the cancel of its timed-out turn unanswered: stopped, the turn with it."""
        if self.stop_agent is None or not await asyncio.to_thread(self._still_open, session_id, turn_id):
            return
        why = (f"the turn watch: the agent did not answer the cancel of timed-out turn {turn_id} within"
               f" {self.answer_s:.0f} s (agents.turn_timeout_s = {self.timeout_s})")
        log_event("turn_cancel_unanswered", f"session {session_id}: {why}; stopping its agent",
                  priority=4, SESSION_ID=session_id, TURN_ID=turn_id)
        try:
            await self.stop_agent(session_id, why)
        except IpcError as exc:
            log.warning("session %s: stopping the agent of its unanswered turn %s failed: %s", session_id, turn_id,
                        exc.message)
