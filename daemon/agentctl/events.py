"""Per-instance event log: ordered, numbered, retained until acknowledged.

Every event an instance produces gets the next ``seq`` (1, 2, ...) of that
instance at the moment it is appended, and is retained in order until the
backend says it has applied it (``discard_through``: ``ack_events`` or the
``after_seq`` of an ``attach``). Nothing is dropped while no stream is
attached (AC-EXECUTORS-SURVIVAL-001.5).

At most one ``Subscription`` (the attached stream) exists per log; a new one
closes the previous. A subscription reads events after its cursor in order,
then waits for live ones, and never skips a retained event.

Every appended event is checked to be sendable as one IPC frame: values
msgpack cannot encode are made plain, and an event whose encoding would not
fit a frame is replaced by a marker saying so, so that one oversized agent
message can never wedge a stream.

The retention bound with producer pause (AC-EXECUTORS-SURVIVAL-001.6) is a
later issue; it will compare ``retained_count`` with the limit and pause the
agent's transport, not this log.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

MAX_EVENT_BYTES = 7 * 1024 * 1024
"""Largest encoded ``data`` of one event (the frame limit is 8 MiB)."""

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Event:
    """One event of an instance: ``{seq, kind, data}`` on the wire."""

    seq: int
    kind: str
    data: dict[str, Any]


def plain(value: Any) -> Any:
    """``value`` made msgpack-safe: JSON-like types, str keys, 64-bit ints (else floats/strs)."""
    if value is None or isinstance(value, bool | str | float | bytes):
        return value
    if isinstance(value, int):
        return value if _INT_MIN <= value <= _INT_MAX else str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return str(value)


def sendable(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` if it encodes into one frame; a plain copy or a size marker otherwise."""
    try:
        size = len(msgpack.packb(data, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        data = plain(data)
        size = len(msgpack.packb(data, use_bin_type=True))
    if size <= MAX_EVENT_BYTES:
        return data
    marker: dict[str, Any] = {k: v for k, v in data.items() if k in ("turn_id", "request_id")}
    marker["oversized"] = {"kind": kind, "bytes": size, "limit": MAX_EVENT_BYTES}
    return marker


class Subscription:
    """The attached stream's view of a log: a cursor plus a wake-up signal."""

    def __init__(self, log: EventLog, cursor: int) -> None:
        self._log = log
        self.cursor = cursor  # next seq to hand out
        self._wake = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        """End the subscription; a pending ``next()`` returns None."""
        self.closed = True
        self._wake.set()

    def notify(self) -> None:
        self._wake.set()

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


class EventLog:
    """Events of one instance, retained in seq order until discarded."""

    def __init__(self) -> None:
        self._events: deque[Event] = deque()
        self._next_seq = 1
        self._subscription: Subscription | None = None
        self._closed = False

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
        """Number and retain one event; None once the log is closed (the instance is gone)."""
        if self._closed:
            return None
        event = Event(self._next_seq, kind, sendable(kind, data))
        self._next_seq += 1
        self._events.append(event)
        if self._subscription is not None:
            self._subscription.notify()
        return event

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
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Detach ``sub`` (no-op if a newer subscription replaced it)."""
        sub.close()
        if self._subscription is sub:
            self._subscription = None

    def close(self) -> None:
        """The instance is gone: end the subscription and throw the retained events away."""
        self._closed = True
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None
        self._events.clear()
