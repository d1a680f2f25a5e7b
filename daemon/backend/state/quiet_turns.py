"""How long each running turn has gone without a word from its agent (Issue 46 Why 5).

A real agent whose provider never answers says nothing at all: no text, no tool call, nothing in
its log. ``QuietTurns`` keeps, for each session with an open turn, when its agent last sent
anything for that turn (a text or thought chunk, a tool call, a plan, a permission request: any
event of the turn, and an ``agent_error``, which belongs to no turn), on an injected monotonic
clock, so the unit tests drive it without sleeping. The backend's event consumer feeds it
(``note_events``) after each committed batch; ``daemon.backend.sessions.turn_watch`` sleeps until
``next_change``, reads it and acts (``on_sooner`` wakes it when a new silence may end sooner).

- **Quiet**: a turn whose agent said nothing for ``warning_s`` seconds (``agents.quiet_warning_s``)
  is reported by ``quiet`` with the real number of seconds; ``follow``, the board and ``session
  show`` print it with a hint. Each further ``warning_s`` is a new *level*, which ``crossed``
  reports once, so a follow stream wakes and prints the new number.
- **Timeout**: a turn quiet for ``timeout_s`` seconds (``agents.turn_timeout_s``; 0: never) is
  reported once by ``due``; the caller ends it with reason ``timeout``.
- While a permission request of the turn is open, the turn waits for its user, not for its agent:
  it is not quiet, and its clock starts again once the request is answered or cancelled.

Anything the agent sends starts a new quiet *period* (``Quiet.period``), so a reader can tell a
second silence from the first one continuing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from daemon.agentctl.protocol import EventKind

Clock = Callable[[], float]


@dataclass(frozen=True)
class Quiet:
    """A turn whose agent has said nothing for ``seconds`` (whole seconds, rounded down)."""

    session_id: str
    turn_id: str
    seconds: int
    period: int  # which silence of the turn this is (anything the agent sends starts a new one)
    level: int  # whole ``warning_s`` in it (1: past the warning once)
    timed_out: bool  # ``due`` reported it: the backend is ending the turn


@dataclass
class _Turn:
    turn_id: str
    since: float  # when its agent last sent anything (or the turn started, or a request was answered)
    period: int = 0
    reported_level: int = 0  # the level ``crossed`` last reported in this period
    asking: set[str] = field(default_factory=set)  # its open permission requests
    timed_out: bool = False


class QuietTurns:
    """The open turn of each session and how long its agent has been silent (see the module doc)."""

    def __init__(self, clock: Clock, warning_s: float, timeout_s: float = 0.0) -> None:
        if warning_s <= 0:
            raise ValueError(f"warning_s must be > 0, not {warning_s}")
        self.clock = clock
        self.warning_s = float(warning_s)
        self.timeout_s = float(timeout_s)  # 0: turns are never timed out
        self._turns: dict[str, _Turn] = {}
        self._periods = 0
        # called when a silence starts that may end sooner than ``next_change`` said (a new turn, an
        # answered permission request): the turn watch sleeps until then, and is woken by it
        self.on_sooner: Callable[[], None] | None = None

    # -- what happens ----------------------------------------------------------------------------

    def started(self, session_id: str, turn_id: str) -> None:
        """A turn opened (the prompt was taken, or its ``turn_started`` event arrived); the same
        turn again changes nothing."""
        turn = self._turns.get(session_id)
        if turn is None or turn.turn_id != turn_id:
            self._turns[session_id] = _Turn(turn_id, self.clock(), self._next_period())
            self._sooner()

    def output(self, session_id: str, turn_id: str) -> None:
        """The agent sent something for ``turn_id``: a new silence starts now. A turn not seen
        starting (a re-tracked agent's) is taken as the session's open turn."""
        turn = self._turns.get(session_id)
        if turn is None or turn.turn_id != turn_id:
            self.started(session_id, turn_id)
            return
        self._restart(turn)

    def heard(self, session_id: str) -> None:
        """The agent said something tied to no turn (an ``agent_error``): its open turn's silence,
        if it has one, starts again."""
        turn = self._turns.get(session_id)
        if turn is not None:
            self._restart(turn)

    def asked(self, session_id: str, turn_id: str, request_id: str) -> None:
        """The agent asked its user for a permission: the turn now waits for the user."""
        self.output(session_id, turn_id)
        self._turns[session_id].asking.add(request_id)

    def answered(self, session_id: str, request_id: str) -> None:
        """A permission request was answered or cancelled: the agent has the word again."""
        turn = self._turns.get(session_id)
        if turn is not None and request_id in turn.asking:
            turn.asking.discard(request_id)
            self._restart(turn)
            self._sooner()

    def ended(self, session_id: str, turn_id: str) -> None:
        turn = self._turns.get(session_id)
        if turn is not None and turn.turn_id == turn_id:
            del self._turns[session_id]

    def forget(self, session_id: str) -> None:
        """The session has no agent any more (or is no longer this backend's)."""
        self._turns.pop(session_id, None)

    # -- what it means ---------------------------------------------------------------------------

    def quiet(self, session_id: str) -> Quiet | None:
        """The session's open turn if its agent has been silent for ``warning_s`` or more."""
        turn = self._turns.get(session_id)
        if turn is None:
            return None
        return self._quiet(session_id, turn, self.clock())

    def all_quiet(self) -> dict[str, Quiet]:
        """``quiet`` of every session that is."""
        now = self.clock()
        found = {sid: self._quiet(sid, turn, now) for sid, turn in self._turns.items()}
        return {sid: q for sid, q in found.items() if q is not None}

    def crossed(self) -> list[Quiet]:
        """The quiet turns that reached a new level since the last call (each level once)."""
        out = []
        for sid, q in self.all_quiet().items():
            turn = self._turns[sid]
            if q.level > turn.reported_level:
                turn.reported_level = q.level
                out.append(q)
        return out

    def due(self) -> list[Quiet]:
        """The turns quiet for ``timeout_s``, each reported once (none when ``timeout_s`` is 0)."""
        if self.timeout_s <= 0:
            return []
        out = []
        now = self.clock()
        for sid, turn in self._turns.items():
            if turn.timed_out or turn.asking or now - turn.since < self.timeout_s:
                continue
            turn.timed_out = True
            q = self._quiet(sid, turn, now)
            assert q is not None
            out.append(q)
        return out

    def next_change(self) -> float | None:
        """Seconds until the next level or timeout is reached (None: no turn is waiting on its agent)."""
        now = self.clock()
        soonest: float | None = None
        for turn in self._turns.values():
            if turn.asking:
                continue
            silent = now - turn.since
            step = (math.floor(silent / self.warning_s) + 1) * self.warning_s - silent
            if self.timeout_s > 0 and not turn.timed_out:
                step = min(step, self.timeout_s - silent)
            soonest = step if soonest is None else min(soonest, step)
        return None if soonest is None else max(0.0, soonest)

    # -- inside ----------------------------------------------------------------------------------

    def _next_period(self) -> int:
        self._periods += 1
        return self._periods

    def _sooner(self) -> None:
        if self.on_sooner is not None:
            self.on_sooner()

    def _restart(self, turn: _Turn) -> None:
        turn.since = self.clock()
        turn.period = self._next_period()
        turn.reported_level = 0

    def _quiet(self, session_id: str, turn: _Turn, now: float) -> Quiet | None:
        silent = now - turn.since
        if turn.asking or silent < self.warning_s:
            return None
        return Quiet(session_id, turn.turn_id, int(silent), turn.period, int(silent // self.warning_s),
                     turn.timed_out)


def note_events(quiet: QuietTurns, session_id: str, events: Iterable[Any]) -> None:
    """Feed a committed batch of one session's control-server events (each with ``.kind`` and
    ``.data``) to ``quiet``: what opens, feeds and ends its turn."""
    for ev in events:
        data = ev.data if isinstance(ev.data, dict) else {}
        turn_id = data.get("turn_id")
        if ev.kind == EventKind.AGENT_EXITED:
            quiet.forget(session_id)
        elif turn_id is None:
            if ev.kind in (EventKind.AGENT_ERROR, EventKind.SESSION_UPDATE):
                quiet.heard(session_id)
        elif ev.kind == EventKind.TURN_STARTED:
            quiet.started(session_id, str(turn_id))
        elif ev.kind == EventKind.TURN_ENDED:
            quiet.ended(session_id, str(turn_id))
        elif ev.kind == EventKind.PERMISSION_REQUEST:
            quiet.asked(session_id, str(turn_id), str(data.get("request_id")))
        elif ev.kind == EventKind.PERMISSION_CANCELLED:
            quiet.answered(session_id, str(data.get("request_id")))
        else:
            quiet.output(session_id, str(turn_id))
