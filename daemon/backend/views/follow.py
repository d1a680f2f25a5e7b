"""The ``follow`` stream op: a session's transcript as it is written (``kandev follow``).

A client opens ``follow`` on its own connection with a session id and, optionally, the cursor
it has already seen (``after_seq``: a transcript entry's ``cursor``, as in ``session show``),
the turn it follows (``turn_id``) and ``all``. After the ok response (the session, the turn
followed and the cursor the stream starts after) the connection carries event frames:

- ``entry`` (seq = the entry's cursor): one transcript entry, in cursor order, each exactly once
  for a given ``after_seq`` (a ``permission_request`` also says whether it is still ``open``);
- ``turn_ended`` (seq = the cursor of the last entry sent): the followed turn is over:
  ``{turn_id, ordinal, state, stop_reason, error}``; sent after every entry of that turn;
- ``quiet`` (same seq): the followed turn's agent has sent nothing for ``agents.quiet_warning_s``
  seconds, and again at each multiple of it (``daemon.backend.views.quiet_report``: the seconds and a
  hint); the turn goes on;
- ``end`` (same seq): the stream is over (``reason``: ``turn_ended``, or ``no_agent`` when there
  is no turn to follow and the session has no running agent), then the backend closes it.

Which turn: the given ``turn_id``, else the session's latest turn (a session without turns: the
first one that starts). Without ``after_seq`` the stream starts at that turn's first entry. It
ends after that turn's ``turn_ended``, at once if the turn is already over. With ``all`` it goes
on through every later turn (a ``turn_ended`` for each) until the client leaves.

The stream sends what is stored, then sleeps until ``TranscriptHub`` says the session changed
(store commits, never a polling loop; a slow re-check every ``RECHECK_S`` only covers liveness,
which lives in memory). Each round reads at most ``ROUND_ENTRIES`` entries or
``ROUND_TEXT_BYTES`` of text in a worker thread, and every frame waits for the client to read
(``send_event`` awaits the socket's drain): a client that does not read stops the stream, it
does not fill the backend's memory.

A session another host of a cluster owns (Issue 47 item 3) streams the same way from the shared
store: its owner's commits NOTIFY ``kandev_transcript`` and this backend's listener
(``daemon.backend.cluster.listener``) hands that to the same hub. The owner's ``replaying_turns`` live
in its memory: a turn that ended while its owner's backend was down, and whose outcome recovery
applied before the replay of its last events, would end a follower on another host before those
events are in. So recovery also marks such a turn in the store (``Turn.replaying``, cleared in the
commit that applies its ``turn_ended`` event), and a stream takes a turn so marked for open,
wherever it runs.

A turn's end is known from its ``turns`` row, not from an entry. So each round reads the turn's
state *first* and the entries *second*: once a turn is seen over, every entry written before its
end is already committed and read in the same round, and ``turn_ended`` comes after all of them.
One exception: after a restart, recovery applies an outcome that arrived while the backend was
away before the consumer replays that turn's events; such a turn (``Execution.replaying_turns``)
counts as open for a stream until its ``turn_ended`` event is applied.

Cursors only grow along the transcript: a writer holds its session's ``transcript_sessions`` row
locked from the cursor it takes until its commit (``daemon.store.transcript``), so a session's
chunks are committed in cursor order and a stream never passes over a chunk that is committed
later with a smaller cursor. A cursor names one chunk even where the store coalesced several into
one row: a stream may stop and resume in the middle of a stored entry.

A store that cannot be reached during a round (PostgreSQL restarting, a dropped connection) does
not end the stream: nothing of that round was sent, and it reads again from where it stood once
the store's reach watch says the server answers again (Issue 47 scenario C).

After a backend restart (SIGKILL, ``kandev down``/``up``, ``systemctl restart``) the client
reconnects with ``after_seq`` = the last cursor it printed and the same ``turn_id``: the
transcript is in the store, re-tracked sessions keep appending to it, so the client gets the rest
exactly once and in order.

A database server that cannot be reached (Issue 47 item 5, ``daemon.store.reach``) pauses a
stream that is open: the failed round is reported, the stream waits until the store's upkeep
reaches the server again and reads the same round again, so the client sees a pause, never an
error or a gap. A new ``follow`` meanwhile is refused with ``store_unreachable``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.api.ops import FollowEnd, FollowEvent
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.state.quiet_turns import QuietTurns
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.quiet_report import QuietOf
from daemon.backend.views.session_view import PAGE_TEXT_BYTES, permissions, transcript_entry
from daemon.store import transcript
from daemon.store.db import Store
from daemon.store.models import TaskSession, Turn
from daemon.store.reach import ReachWatch
from daemon.store.states import SessionState, TurnState
from ipc.errors import ErrorCode, IpcError
from ipc.framing import ConnectionClosed
from ipc.server import ConnectionContext

ROUND_ENTRIES = 500
"""Entries one round reads and sends at most."""
ROUND_TEXT_BYTES = PAGE_TEXT_BYTES
"""Characters of entry text one round reads at most (entries are cut at 256 KiB each)."""
RECHECK_S = 30.0
"""Seconds a stream sleeps at most without a store change (liveness is not in the store)."""
_ENTRY_OVERHEAD = 128
log = logging.getLogger(__name__)

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True)
class StreamEvent:
    seq: int
    kind: FollowEvent
    data: dict[str, Any]


@dataclass
class Position:
    """Where one stream stands: the last cursor sent, the turn followed, whether its end was sent."""

    session_id: str
    cursor: int
    turn_id: str | None
    follow_all: bool
    turn_end_sent: bool = False


@dataclass
class Round:
    """What one read of the store gives a stream to send."""

    events: list[StreamEvent] = field(default_factory=list)
    done: bool = False  # the stream ends after these events
    more: bool = False  # read again at once (a full round, or a turn began in this one)


def _outcome(db: Session, turn_id: str) -> dict[str, Any] | None:
    """The turn's outcome, or None while it is open (or unknown)."""
    turn = db.get(Turn, turn_id)
    if turn is None or turn.state == TurnState.OPEN:
        return None
    if turn.state == TurnState.FINISHED and turn.replaying:
        return None  # its outcome is stored, its last events are still being replayed (on its host)
    return {"turn_id": turn.id, "ordinal": turn.ordinal, "state": turn.state, "stop_reason": turn.stop_reason,
            "error": turn.error, "ended_at": turn.ended_at.isoformat() if turn.ended_at else None}


def _first_cursor_of(db: Session, session_id: str, turn_id: str) -> int:
    """The cursor just before the turn's first entry (before everything to come if it has none yet)."""
    first = transcript.first_cursor_of_turn(db, session_id, turn_id)
    if first is not None:
        return first - 1
    return transcript.last_cursor(db, session_id)


def start_position(
    db: Session, session_id: str, *, after_seq: int | None, turn_id: str | None, follow_all: bool
) -> tuple[Position, dict[str, Any]]:
    """Where a new stream starts, and its ok result; ``not_found`` for an unknown session or turn."""
    session = db.get(TaskSession, session_id)
    if session is None:
        raise IpcError(ErrorCode.NOT_FOUND, f"no session with id {session_id!r}")
    if after_seq is not None and after_seq < 0:
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"follow: after_seq must be >= 0, not {after_seq}")
    if turn_id is not None:
        turn = db.get(Turn, turn_id)
        if turn is None or turn.session_id != session_id:
            raise IpcError(ErrorCode.NOT_FOUND, f"session {session_id} has no turn {turn_id!r}")
    else:
        turn = db.scalars(select(Turn).where(Turn.session_id == session_id).order_by(Turn.ordinal.desc())
                          .limit(1)).first()
    if after_seq is None:
        if turn is not None:
            after_seq = _first_cursor_of(db, session_id, turn.id)
        else:
            after_seq = transcript.last_cursor(db, session_id)
    position = Position(session_id, after_seq, turn.id if turn is not None else None, follow_all)
    result = {
        "session_id": session.id,
        "task_id": session.task_id,
        "agent": session.agent,
        "state": session.state,
        "turn_id": position.turn_id,
        "turn_ordinal": turn.ordinal if turn is not None else None,
        "after_seq": after_seq,
        "all": follow_all,
    }
    return position, result


def read_round(
    db: Session, pos: Position, *, live: bool, limit: int = ROUND_ENTRIES, text_budget: int = ROUND_TEXT_BYTES,
    replaying: frozenset[str] = frozenset(), host: str | None = None,
) -> Round:
    """Read what the stream at ``pos`` sends next and advance ``pos`` (see the module doc).
    ``replaying``: turns whose outcome is stored but whose entries are still being replayed.
    ``host``: this backend's cluster host; a session another host owns counts as live while its
    stored state says it has an agent (its executions are that host's)."""
    out = Round()
    turn_at_read = pos.turn_id
    # The turn's state first, then the entries: if the turn is over now, all its entries are in
    # (unless recovery applied its outcome before replaying its events: then it counts as open).
    over = pos.turn_id is not None and not pos.turn_end_sent and pos.turn_id not in replaying
    ended = _outcome(db, pos.turn_id) if over and pos.turn_id is not None else None
    ended_at = _parse(ended.get("ended_at")) if ended is not None else None
    rows = list(itertools.islice(transcript.chunks_after(db, pos.session_id, pos.cursor), limit))
    full = len(rows) == limit
    budget = text_budget
    open_requests: set[str] | None = None  # read once a round shows a permission request
    for row in rows:
        cost = len(row.text) + _ENTRY_OVERHEAD
        if out.events and cost > budget:
            full = True
            break
        budget -= cost
        if (ended is not None and ended_at is not None and row.turn_id != pos.turn_id
                and row.created_at is not None and row.created_at > ended_at):
            # Written after the followed turn ended (e.g. a resume note): its end line comes first.
            out.events.append(StreamEvent(pos.cursor, FollowEvent.TURN_ENDED, ended))
            pos.turn_end_sent, ended = True, None
            if not pos.follow_all:
                return _end(out, pos, FollowEnd.TURN_ENDED)
        if row.kind == "prompt" and row.turn_id and row.turn_id != pos.turn_id:
            # A new turn began, so the one followed is over.
            if pos.turn_id is not None:
                if not pos.turn_end_sent:
                    outcome = _outcome(db, pos.turn_id) or {"turn_id": pos.turn_id, "ordinal": None,
                                                            "state": "unknown", "stop_reason": None, "error": None}
                    out.events.append(StreamEvent(pos.cursor, FollowEvent.TURN_ENDED, outcome))
                    pos.turn_end_sent = True
                if not pos.follow_all:
                    return _end(out, pos, FollowEnd.TURN_ENDED)
            pos.turn_id, pos.turn_end_sent, ended = row.turn_id, False, None
        if not pos.follow_all and row.turn_id and row.turn_id != pos.turn_id:
            pos.cursor = row.cursor  # a late entry of another turn: not this stream's
            continue
        entry = transcript_entry(row)
        if row.kind == "permission_request":
            if open_requests is None:
                open_requests = {p["request_id"] for p in permissions(db, pos.session_id) if p["state"] == "open"}
            entry["open"] = _request_id(row.text) in open_requests  # still waiting for an answer
        out.events.append(StreamEvent(row.cursor, FollowEvent.ENTRY, entry))
        pos.cursor = row.cursor
    if full or pos.turn_id != turn_at_read:
        out.more = True  # more stored, or a turn began whose state is not read yet
        return out
    if ended is not None and not pos.turn_end_sent:
        out.events.append(StreamEvent(pos.cursor, FollowEvent.TURN_ENDED, ended))
        pos.turn_end_sent = True
        if not pos.follow_all:
            return _end(out, pos, FollowEnd.TURN_ENDED)
    if not pos.follow_all and pos.turn_id is None and not live:
        session = db.get(TaskSession, pos.session_id)
        remote_live = (session is not None and host is not None and session.host not in (None, host)
                       and session.state in (SessionState.RUNNING, SessionState.WAITING_FOR_INPUT))
        if session is None or (session.state not in (SessionState.CREATED, SessionState.STARTING)
                               and not remote_live):
            return _end(out, pos, FollowEnd.NO_AGENT)
    return out


def _not_ended_for_want_of_an_agent(step: Round) -> None:
    """Take back a ``no_agent`` end from ``step``: a launch commits its session's state and starts
    tracking it in one step of the loop, which can fall during a round's read (the round saw no
    agent, then a session waiting for input). The next round reads again, with the agent."""
    last = step.events[-1] if step.events else None
    if (step.done and last is not None and last.kind == FollowEvent.END
            and last.data.get("reason") == FollowEnd.NO_AGENT):
        step.events.pop()
        step.done = False
        step.more = True


def _parse(when: str | None) -> datetime | None:
    return datetime.fromisoformat(when) if when else None


def _request_id(text: str) -> str | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return str(data.get("request_id")) if isinstance(data, dict) else None


def _end(out: Round, pos: Position, reason: FollowEnd) -> Round:
    out.events.append(StreamEvent(pos.cursor, FollowEvent.END, {"reason": reason.value}))
    out.done = True
    return out


class FollowService:
    """Serves ``follow`` streams from the store, woken by the hub."""

    def __init__(self, store: Store, hub: TranscriptHub, executions: ExecutionStore,
                 quiet: QuietTurns | None = None, report: QuietOf | None = None,
                 reach: ReachWatch | None = None, host: str | None = None) -> None:
        self.store = store
        self.reach = reach  # a round that finds the database server gone waits for it
        self.host = host  # this backend's cluster host (None: a single host); woken by kandev_transcript
        self.hub = hub
        self.executions = executions
        self.quiet = quiet  # how long each running turn's agent has been silent
        self.report = report  # a silence as the stream sends it (daemon.backend.views.quiet_report)

    def _quiet_news(self, pos: Position, agent: str | None, sent: tuple[int, int] | None
                    ) -> tuple[tuple[int, int], dict[str, Any]] | None:
        """The followed turn's silence, when it reached a level this stream has not sent yet."""
        if self.quiet is None or self.report is None or pos.turn_id is None or pos.turn_end_sent:
            return None
        q = self.quiet.quiet(pos.session_id)
        if q is None or q.turn_id != pos.turn_id or (q.period, q.level) == sent:
            return None
        data = self.report(pos.session_id, agent)
        return ((q.period, q.level), data) if data is not None else None

    def _start(self, session_id: str, args: dict[str, Any]) -> tuple[Position, dict[str, Any]]:
        with self.store.session() as db:
            return start_position(db, session_id, after_seq=args.get("after_seq"), turn_id=args.get("turn_id"),
                                  follow_all=bool(args.get("all", False)))

    def _round(self, pos: Position, live: bool, replaying: frozenset[str]) -> Round:
        with self.store.session() as db:
            return read_round(db, pos, live=live, replaying=replaying, host=self.host)

    async def _next_round(self, pos: Position, live: bool, replaying: frozenset[str]) -> Round | None:
        """The next round, or None after waiting for an unreachable database server to be back (the
        position as it was before the failed round: a round moves it as it reads, and the read's
        end, its commit, can fail after that)."""
        if self.reach is not None and self.reach.unreachable:
            await self.reach.wait_reachable()
            return None
        before = dataclasses.replace(pos)
        try:
            return await asyncio.to_thread(self._round, pos, live, replaying)
        except Exception as exc:
            if self.reach is None or not self.reach.failed(exc):
                raise
        for name, value in vars(before).items():
            setattr(pos, name, value)
        await self.reach.wait_reachable()
        return None

    async def op_follow(self, ctx: ConnectionContext, args: dict[str, Any]) -> None:
        session_id = args["session_id"]
        async with self.hub.watching(session_id) as watch:  # before the first read: no change is missed
            pos, result = await asyncio.to_thread(self._start, session_id, args)
            try:
                await ctx.start_stream(result)
                quiet_sent: tuple[int, int] | None = None  # the silence (period, level) last sent
                while True:
                    seen = watch.version
                    ex = self.executions.executions.get(session_id)
                    live = ex is not None
                    # read before the round: a turn leaves the set only after its entries committed
                    replaying = frozenset(ex.replaying_turns) if ex is not None else frozenset()
                    step = await self._next_round(pos, live, replaying)
                    if step is None:
                        continue  # the database server was away: read this round again
                    if not live and self.executions.executions.get(session_id) is not None:
                        _not_ended_for_want_of_an_agent(step)  # it got one during the read
                    for ev in step.events:
                        await ctx.send_event(ev.seq, ev.kind.value, ev.data)  # waits while the client is slow
                    if step.done:
                        return
                    if not step.more:
                        news = self._quiet_news(pos, result.get("agent"), quiet_sent)
                        if news is not None:
                            quiet_sent, data = news
                            await ctx.send_event(pos.cursor, FollowEvent.QUIET.value, data)
                        await watch.wait(seen, RECHECK_S)
            except ConnectionClosed:
                return  # the client left

    def handlers(self) -> dict[str, Handler]:
        return {"follow": self.op_follow}
