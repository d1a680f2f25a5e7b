"""Per-instance event log: ordered, numbered, retained until acknowledged.

Every event an instance produces gets the next ``seq`` (1, 2, ...) of that
instance at the moment it is appended, and is retained in order until the
backend says it has applied it (``discard_through``: ``ack_events`` or the
``after_seq`` of an ``attach``). Nothing is dropped while no stream is
attached (AC-EXECUTORS-SURVIVAL-001.5).

At most one ``Subscription`` (the attached stream) exists per log; a new one
closes the previous. A subscription reads events after its cursor in order,
then waits for live ones, and never skips a retained event. Each has a random
``token`` (unique across re-executions of the server), so a request to end one
stream (``unsubscribe_token``) can never end a newer one. A stream that serves
many logs (``attach_many``) sets each subscription's ``listener`` and waits on
its own wake-up instead of one per subscription.

Every appended event is checked to be sendable as one IPC frame: values
msgpack cannot encode are made plain, and an event whose encoding would not
fit a frame is replaced by a marker saying so, so that one oversized agent
message can never wedge a stream.

Detached retention bound (AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6,
AC-EXECUTORS-SURVIVAL-001.9, AC-EXECUTORS-SURVIVAL-001.10).
``EventLog(limit=N)`` (``detached_event_limit``) never refuses or drops an
event: ``append`` always retains. The bound is enforced where the agent's
output enters the server: before the instance's transport hands the agent's
next message over (to become an event) it awaits ``wait_for_room()``, which
parks while the log is *full*::

    full = not closed and limit is armed and not attached and retained_count >= limit

- ``retained_count`` counts every event not yet discarded (acked). An event a
  dropped stream had sent but nobody acked is counted too: the server cannot
  know it was applied, so it is still owed to the next backend.
- ``attached`` is this log's own stream (AC-EXECUTORS-SURVIVAL-001.9), never server ownership.
  While attached nothing parks: the backend acks as it applies, so retention
  stays today's "until acked".
- Parked, the transport does not read, the agent's stdout pipe fills and the
  agent blocks in its own write: that is the pause. ``paused`` reports a
  parked producer (a message held back); a full log whose agent is silent is
  not paused, and its next message will be held back. Nothing is dropped, for
  every kind in ``RETAINED_KINDS`` (below, the closed list).
- What releases a parked producer: a stream attaching, ``discard_through``
  (ack / attach ``after_seq``) making room, and ``close()`` (the instance
  stops: every parked producer is released at once and retained events are
  thrown away, AC-EXECUTORS-SURVIVAL-001.10). ``close`` is the stop signal of the wait, and no
  lock is held while waiting, so stop can never deadlock on a parked producer.
  An event of the agent is handed over only while ``retained_count < limit``,
  so the agent alone never takes the log past the limit.
- Events the server itself appends (``turn_started``, ``turn_ended``,
  ``agent_exited``, ``permission_cancelled``) never wait: they are appended
  even when the log is full; why that cannot grow it without bound is in
  docs/architecture.md#the-control-server-inside ("How the pause is built").
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from daemon.agentctl.instance.agent_json import clean_str
from daemon.agentctl.protocol import EventKind
from ipc.codec_msgpack import pack

# The closed list of docs/architecture.md#the-control-server-inside, as code: every event kind the log carries
# and whether it is retained at the bound (parks the producer, never dropped)
# or excluded. Kandev's only exclusions were its two MCP-attachment reports;
# this project has no MCP-attachment events, so the excluded list is EMPTY.
# A new EventKind must be added to exactly one of the two (a unit test checks).
RETAINED_KINDS: tuple[str, ...] = (
    EventKind.SESSION_UPDATE,  # every ACP session/update (chunks, tool calls, mode/config/model/usage updates)
    EventKind.AGENT_ERROR,  # a line on the agent's stdout that is not JSON-RPC
    EventKind.AGENT_EXITED,  # process exit with exit code and stderr tail
    EventKind.PERMISSION_REQUEST,  # session/request_permission: stays open while detached (AC-EXECUTORS-SURVIVAL-001.9)
    EventKind.PERMISSION_CANCELLED,  # an open request answered "cancelled" by the server (cancel, agent exit)
    EventKind.TURN_STARTED,  # server-originated
    EventKind.TURN_ENDED,  # server-originated: the turn's outcome (also kept in turn_status until ack_turn)
)
EXCLUDED_KINDS: tuple[str, ...] = ()
"""Kinds that would never park a producer; empty: no MCP-attachment events exist here."""

MAX_EVENT_BYTES = 7 * 1024 * 1024
"""Largest encoded ``data`` of one event (the frame limit is 8 MiB)."""

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


class Event(NamedTuple):
    """One event of an instance: ``{seq, kind, data}`` on the wire. A named tuple: one is built per event
    streamed, in half the time of a frozen dataclass."""

    seq: int
    kind: str
    data: dict[str, Any]
    packed: bytes | None = None  # ``data`` in msgpack (None: not packed here, e.g. handed over)

    def wire(self) -> tuple[int, str, bytes]:
        """``(seq, kind, data in msgpack)``, what ``codec_msgpack``'s event frames are made of."""
        return self.seq, self.kind, self.packed if self.packed is not None else pack(self.data)


def plain(value: Any) -> Any:
    """``value`` made msgpack-safe: JSON-like types, str keys, 64-bit ints (else floats/strs), and
    text without lone surrogates (``daemon.agentctl.instance.agent_json``)."""
    if value is None or isinstance(value, bool | float | bytes):
        return value
    if isinstance(value, str):
        return clean_str(value)
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else str(value)
    if isinstance(value, dict):
        return {clean_str(str(k)): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return clean_str(str(value))


def sendable(kind: str, data: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """``data`` if it encodes into one frame, else a plain copy or a size marker; with what it
    encodes into (packed once, here: the stream sends these bytes)."""
    try:
        packed = pack(data)
    except (TypeError, ValueError, OverflowError):
        data = plain(data)
        packed = pack(data)
    if len(packed) <= MAX_EVENT_BYTES:
        return data, packed
    marker: dict[str, Any] = {k: v for k, v in data.items() if k in ("turn_id", "request_id")}
    marker["oversized"] = {"kind": kind, "bytes": len(packed), "limit": MAX_EVENT_BYTES}
    return marker, pack(marker)


class Subscription:
    """The attached stream's view of a log: a cursor plus a wake-up signal."""

    def __init__(self, log: EventLog, cursor: int) -> None:
        self._log = log
        self.cursor = cursor  # next seq to hand out
        self._wake = asyncio.Event()
        self.closed = False
        self.token = os.urandom(8).hex()
        """Names this stream (and no other, even after a re-exec) in ``EventLog.unsubscribe_token``."""
        self.listener: Callable[[], None] | None = None
        """Called when an event is appended or the subscription closes (a stream of many logs)."""

    def close(self) -> None:
        """End the subscription; a pending ``next()`` returns None."""
        self.closed = True
        self._wake.set()
        if self.listener is not None:
            self.listener()

    def notify(self) -> None:
        self._wake.set()
        if self.listener is not None:
            self.listener()

    async def next(self) -> Event | None:
        """The next event in seq order, waiting for it if needed; None once closed."""
        while True:
            if self.closed:
                return None
            self.cursor = max(self.cursor, self._log.first_seq)
            event = self._log.get(self.cursor)
            if event is not None:
                self.cursor += 1
                return event
            self._wake.clear()
            await self._wake.wait()

    def ready(self, limit: int) -> list[Event]:
        """The events already retained after the cursor, in seq order, at most ``limit``; never
        waits (the stream sends what ``next()`` returned together with these in one write)."""
        events: list[Event] = []
        while len(events) < limit and not self.closed:
            self.cursor = max(self.cursor, self._log.first_seq)
            event = self._log.get(self.cursor)
            if event is None:
                break
            self.cursor += 1
            events.append(event)
        return events


class EventLog:
    """Events of one instance, retained in seq order until discarded.

    ``limit`` is the detached retention bound; None (the default, and what an
    instance uses until its handshake is done) means producers never park.
    """

    def __init__(self, limit: int | None = None) -> None:
        self._events: deque[Event] = deque()
        self._next_seq = 1
        self._subscription: Subscription | None = None
        self._closed = False
        self._limit = limit
        self._room = asyncio.Event()  # set while producers may go on (mirrors ``has_room``)
        self._room.set()
        self._parked = 0  # producers waiting in wait_for_room
        self._update_room()

    # -- the detached bound (module docstring) ---------------------------------

    @property
    def limit(self) -> int | None:
        return self._limit

    def set_limit(self, limit: int | None) -> None:
        """Arm (or change, or with None disarm) the detached bound."""
        if limit is not None and limit < 1:
            raise ValueError(f"detached event limit must be >= 1, not {limit}")
        self._limit = limit
        self._update_room()

    @property
    def has_room(self) -> bool:
        """Whether a producer may hand over the agent's next message now."""
        return (
            self._closed
            or self._limit is None
            or self.attached
            or len(self._events) < self._limit
        )

    @property
    def paused(self) -> bool:
        """Whether a producer is parked in ``wait_for_room`` right now."""
        return self._parked > 0

    @property
    def closed(self) -> bool:
        return self._closed

    def _update_room(self) -> None:
        if self.has_room:
            self._room.set()
        else:
            self._room.clear()

    async def wait_for_room(self) -> None:
        """Park until the log is not full; at once if it is not.

        Released by an attach, a discard that makes room, or ``close()`` (the
        instance's stop signal): never waits for a backend once the instance
        stops. Callers must not hold any lock that stop or close takes.
        """
        if self.has_room:
            return
        self._parked += 1
        try:
            while not self.has_room:
                await self._room.wait()
        finally:
            self._parked -= 1

    @property
    def next_seq(self) -> int:
        """The seq the next appended event gets."""
        return self._next_seq

    @property
    def last_seq(self) -> int:
        """The seq of the newest event ever appended (0 if none)."""
        return self._next_seq - 1

    @property
    def first_seq(self) -> int:
        """The seq of the oldest retained event (``next_seq`` if none is retained)."""
        return self._events[0].seq if self._events else self._next_seq

    @property
    def retained_count(self) -> int:
        """How many events are retained (appended and not yet discarded)."""
        return len(self._events)

    @property
    def attached(self) -> bool:
        """Whether a stream is attached (AC-EXECUTORS-SURVIVAL-001.9 reads this per instance)."""
        return self._subscription is not None and not self._subscription.closed

    def append(self, kind: str, data: dict[str, Any]) -> Event | None:
        """Number and retain one event; None once the log is closed (the instance is gone).

        Never refuses and never waits: the bound is applied before the agent's
        message is read (``wait_for_room``), not here.
        """
        if self._closed:
            return None
        event = Event(self._next_seq, kind, *sendable(kind, data))
        self._next_seq += 1
        self._events.append(event)
        if self._subscription is not None:
            self._subscription.notify()
        self._update_room()
        return event

    def retained(self) -> list[Event]:
        """Every retained event, oldest first (a re-exec hands them over)."""
        return list(self._events)

    def restore(self, next_seq: int, events: list[tuple[int, str, dict[str, Any]]]) -> None:
        """Take over the log of a previous process image: its retained events and its next seq.
        Only on a fresh log; the events must be consecutive and below ``next_seq``."""
        if self._events or self._next_seq != 1:
            raise RuntimeError("restore() needs a fresh log")
        expected = next_seq - len(events)
        for seq, kind, data in events:
            if seq != expected:
                raise ValueError(f"retained events are not consecutive up to next_seq {next_seq}")
            self._events.append(Event(seq, kind, data))
            expected += 1
        self._next_seq = next_seq
        self._update_room()

    def get(self, seq: int) -> Event | None:
        index = seq - self.first_seq
        if 0 <= index < len(self._events):
            return self._events[index]
        return None

    def discard_through(self, seq: int) -> int:
        """Drop every retained event with seq <= ``seq``; returns how many were dropped."""
        dropped = 0
        while self._events and self._events[0].seq <= seq:
            self._events.popleft()
            dropped += 1
        if dropped:
            self._update_room()
        return dropped

    def subscribe(self, after_seq: int) -> Subscription:
        """Attach: discard <= ``after_seq``, close any previous subscription, start after it."""
        if self._subscription is not None:
            self._subscription.close()
        self.discard_through(after_seq)
        sub = Subscription(self, after_seq + 1)
        if self._closed:
            sub.close()
        self._subscription = sub
        self._update_room()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Detach ``sub`` (no-op if a newer subscription replaced it)."""
        sub.close()
        if self._subscription is sub:
            self._subscription = None
        self._update_room()

    def unsubscribe_token(self, token: str) -> bool:
        """Detach the stream ``token`` names if it is still this log's; False if it is not (ended,
        or replaced by a newer attach, which a late request must never end)."""
        sub = self._subscription
        if sub is None or sub.token != token:
            return False
        self.unsubscribe(sub)
        return True

    def close(self) -> None:
        """The instance is gone: end the subscription, throw the retained events away and
        release every parked producer at once (AC-EXECUTORS-SURVIVAL-001.10)."""
        self._closed = True
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self._events.clear()
        self._update_room()
