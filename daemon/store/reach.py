"""A database server that went away is an episode, not a crash (Issue 47 item 5).

A PostgreSQL store (``database.url``) lives in another process, often on another machine: it
restarts, fails over, or ends a connection (``pg_terminate_backend``, an idle timeout, a network
cut). ``is_unreachable(exc)`` says whether a failed store call failed because the server could not
be reached: a connection that could not be made or broke (SQLAlchemy marks such an error
``connection_invalidated``, psycopg raises ``OperationalError`` without an SQLSTATE), SQLSTATE
class 08 (connection exception), or the server shutting down or starting (``57P01``
admin_shutdown, ``57P02`` crash_shutdown, ``57P03`` cannot_connect_now). An SQLite store is a
file, never unreachable: nothing SQLite raises matches.

``ReachWatch`` has the shape of ``daemon.store.space.SpaceWatch``: every store user that can meet
such a failure reports it (``failed(exc)``), which opens an episode and logs ``store_unreachable``
once; while it lasts nothing writes to the store (the event consumers wait with their streams
detached, so the control server keeps the agents' events, ``daemon.backend.state.executions``)
and the store's upkeep alone tries to reach the server again, with a growing delay
(``next_delay``: at once, since a dropped connection is replaced in a moment, then
``FIRST_RETRY_S`` doubling up to ``MAX_RETRY_S``, with jitter so that many backends do not knock
at once); the first probe that commits ends it (``succeeded()``, logging
``store_reachable`` with how long it lasted) and wakes whoever waits (``wait_reachable``). A
failed transaction is rolled back whole by the server, so nothing is half-applied, and an event
is acknowledged to the control server only after its batch committed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from daemon.core.journal import log_event

FIRST_RETRY_S = 0.25
"""Seconds before the first attempt to reach the server again."""
MAX_RETRY_S = 2.0
"""The longest delay between two attempts (a restart takes seconds; a probe costs one connection)."""
SHUTDOWN_STATES = frozenset({"57P01", "57P02", "57P03"})
"""admin_shutdown, crash_shutdown, cannot_connect_now: the server stops or is not ready yet."""
WHERE = "database.url"
"""How messages name the server (the URL itself may hold a password)."""


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (a failed store call) means the database server could not be reached."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "connection_invalidated", False) is True:  # SQLAlchemy: a disconnect
            return True
        state = getattr(current, "sqlstate", None)
        if isinstance(state, str) and (state.startswith("08") or state in SHUTDOWN_STATES):
            return True
        kind = type(current)
        if kind.__module__.startswith("psycopg") and state is None and kind.__name__ in (
                "OperationalError", "InterfaceError"):
            return True  # no SQLSTATE: the connection could not be made, or it is closed
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


REFUSALS = ("password authentication failed", "authentication failed", "no password supplied",
            "pg_hba.conf", "does not exist", "permission denied")
"""What the server (or libpq) says when it answered and refused the connection: a wrong or missing
password, an unknown role or database, no pg_hba.conf entry. psycopg reports these without an
SQLSTATE, like a server that cannot be reached; waiting would not make them pass."""


def refused_connection(exc: BaseException) -> bool:
    """Whether a failed connection was answered and refused (see ``REFUSALS``): a configuration to
    correct, not an outage to wait out (``daemon.backend.lifetime.reach_wait`` exits on it)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if any(refusal in text for refusal in REFUSALS):
            return True
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return False


def next_delay(attempt: int) -> float:
    """Seconds before attempt ``attempt`` (0: the first, at once) to reach the server again:
    ``FIRST_RETRY_S`` doubled at each attempt up to ``MAX_RETRY_S``, give or take 20 %."""
    if attempt <= 0:
        return 0.0
    return float(min(FIRST_RETRY_S * 2.0 ** (attempt - 1), MAX_RETRY_S) * random.uniform(0.8, 1.2))


@dataclass
class Unreachable:
    since: float  # wall clock, for people
    detail: str
    attempts: int = 0  # probes that failed since
    began: float = field(default_factory=time.monotonic)  # what its duration is measured from


class ReachWatch:
    """Whether the database server can be reached, as the backend last found it."""

    def __init__(self) -> None:
        self.state: Unreachable | None = None
        self.episodes = 0
        self._back: asyncio.Event | None = None

    @property
    def unreachable(self) -> bool:
        return self.state is not None

    def failed(self, exc: BaseException) -> bool:
        """Note a failed store call; True (and the episode reported) if the server was unreachable."""
        if not is_unreachable(exc):
            return False
        detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if self.state is None:
            self.state = Unreachable(time.time(), detail)
            self.episodes += 1
            log_event("store_unreachable", f"the database server ({WHERE}) is unreachable: {detail}; events are not"
                      " stored and stay with the control server (agents keep running, pausing at their bound),"
                      " and operations that need the store are refused with store_unreachable until it is back",
                      priority=3, DETAIL=detail)
        else:
            self.state.detail = detail
        return True

    def probe_failed(self, exc: BaseException) -> None:
        """A probe of the upkeep failed (whatever the reason): one more attempt."""
        if self.state is not None:
            self.state.attempts += 1
            if is_unreachable(exc):
                self.state.detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]

    def succeeded(self) -> None:
        """A store call committed: if the server was unreachable, it is back."""
        state, self.state = self.state, None
        if state is None:
            return
        log_event("store_reachable", f"the database server ({WHERE}) is reachable again after"
                  f" {time.monotonic() - state.began:.1f} s; the stored events catch up",
                  UNREACHABLE_MS=int((time.monotonic() - state.began) * 1000), ATTEMPTS=state.attempts)
        if self._back is not None:
            self._back.set()
            self._back = None

    async def wait_reachable(self) -> None:
        """Until the episode ends (the upkeep's probe reached the server); at once when there is none."""
        if self.state is None:
            return
        if self._back is None:
            self._back = asyncio.Event()
        await self._back.wait()

    def status(self) -> dict[str, Any]:
        """``kandev status``'s ``store.reachable``, ``store.unreachable_since`` and ``store.unreachable``."""
        s = self.state
        if s is None:
            return {"reachable": True, "unreachable_since": None, "unreachable": None}
        return {"reachable": False, "unreachable_since": s.since,
                "unreachable": {"since": s.since, "seconds": round(time.monotonic() - s.began, 1),
                                "detail": s.detail, "attempts": s.attempts}}
