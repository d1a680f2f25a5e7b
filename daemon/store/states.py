"""The named states of the store's rows, as ``StrEnum``s (and the board's attention reasons).

A member compares equal to its string and formats as it (``str(SessionState.FAILED) ==
"FAILED"``), so what the store holds and what the wire carries stay the plain strings they always
were; code names the state instead of spelling it. The CHECK constraints of ``daemon.store.models``
and the session state machine of ``daemon.store.transitions`` are built from these.
"""

from __future__ import annotations

from enum import Enum, StrEnum


class SessionState(StrEnum):
    CREATED = "CREATED"
    STARTING = "STARTING"  # an agent is being launched (start, resume, context reset)
    RUNNING = "RUNNING"  # a turn is in progress
    WAITING_FOR_INPUT = "WAITING_FOR_INPUT"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class TaskState(StrEnum):
    BACKLOG = "backlog"
    IN_PROGRESS = "in_progress"
    REVIEW = "review"
    DONE = "done"


class TurnState(StrEnum):
    """A turn: in progress (``open``), ended by its agent (``finished``, with a stop reason), or
    ended without one (``abandoned``: its agent is gone)."""

    OPEN = "open"
    FINISHED = "finished"
    ABANDONED = "abandoned"


class InventoryStatus(StrEnum):
    """An ``executors_running`` row: its agent believed running (``live``) or known gone (``stale``)."""

    LIVE = "live"
    STALE = "stale"


class LaunchMode(StrEnum):
    """How a control server was started: a systemd unit, detached from the backend, or its child."""

    UNIT = "unit"
    DETACHED = "detached"
    CHILD = "child"


class Attention(str, Enum):
    """Why a task needs its user, in a word."""

    PERMISSION = "permission"  # the agent waits for an answer to a permission request
    FAILED = "failed"  # the session failed, or its last turn did
    CANCELLED = "cancelled"  # the session was cancelled
    TIMEOUT = "timeout"  # its last turn was ended for its agent's silence (agents.turn_timeout_s)
    NO_AGENT = "no agent"  # the session waits for input but has no agent to answer it
