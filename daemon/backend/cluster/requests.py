"""The request queue between the hosts of a cluster (Issue 47 item 2), over the ``cluster_requests`` table.

A backend that is asked to drive a session another host owns writes a request row (``enqueue``:
target host, its own host, the op and its arguments) and NOTIFYs ``kandev_requests`` with the
target's name, in the same transaction (PostgreSQL delivers a NOTIFY at commit, so a woken backend
always finds the row). The owning backend takes one request at a time with ``claim``: ``SELECT ...
FOR UPDATE SKIP LOCKED`` of its oldest pending row, marked ``running`` in the claiming transaction.
Two backends racing, or one backend woken twice, never get the same row: the second reader skips
the locked row, and once the claim commits the row is no longer ``pending``. ``finish`` writes the
result or the typed error, marks the row ``done`` and NOTIFYs ``kandev_results`` with its id.

What happens to a request when something dies (the choice is "at most once, and say so"):

- the requester gives up (the owner did not claim it within its bound): ``give_up`` marks a row that
  is still ``pending`` done with that error, atomically, so the owner never runs it later;
- the owner is killed between its claim and ``finish``: the row stays ``running``. It is never run
  again: when that host's backend starts, ``answer_interrupted`` answers each such row with the typed
  error ``request_interrupted`` (the op may or may not have taken effect; ``session show`` says
  which), and a requester still waiting gets that answer;
- requests still ``pending`` when the owner starts (written while it was down, by a requester that
  is still waiting) are claimed as usual.

Everything here runs in a caller's transaction (a worker thread's ``Store.session``); the caller commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, func, select, update
from sqlalchemy.orm import Session

from daemon.store.models import ClusterRequest, utcnow
from ipc.errors import IpcError

REQUESTS_CHANNEL = "kandev_requests"
"""NOTIFY channel: a request for the host named by the payload was written."""
RESULTS_CHANNEL = "kandev_results"
"""NOTIFY channel: the request whose id is the payload was answered."""
TRANSCRIPT_CHANNEL = "kandev_transcript"
"""NOTIFY channel: the transcript or turns of the session whose id is the payload changed."""

PENDING, RUNNING, DONE = "pending", "running", "done"

REQUEST_INTERRUPTED = "request_interrupted"
"""Error code: the owning backend stopped while it carried the request out; it may or may not have run."""
HOST_UNREACHABLE = "host_unreachable"
"""Error code: the host that owns the session does not answer (no heartbeat, or no claim in time)."""


@dataclass(frozen=True)
class Request:
    """One claimed request: what to run on this host."""

    id: int
    origin_host: str
    op: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    """A request as its requester reads it."""

    state: str
    result: dict[str, Any] | None
    error: dict[str, Any] | None


def _changed(db: Session, statement: Any) -> int:
    """Rows an UPDATE or DELETE changed."""
    return int(cast("CursorResult[Any]", db.execute(statement)).rowcount or 0)


def notify(db: Session, channel: str, payload: str) -> None:
    """NOTIFY ``channel`` when this transaction commits (PostgreSQL only; nothing on SQLite)."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(select(func.pg_notify(channel, payload)))


def error_dict(exc: IpcError) -> dict[str, Any]:
    """A typed error as a row stores it (the protocol's error map)."""
    out: dict[str, Any] = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
    if exc.details is not None:
        out["details"] = exc.details
    return out


def error_of(stored: dict[str, Any]) -> IpcError:
    """The typed error a stored error map stands for."""
    details = stored.get("details")
    return IpcError(str(stored.get("code", "internal")), str(stored.get("message", "")),
                    bool(stored.get("retryable", False)), details if isinstance(details, dict) else None)


def enqueue(db: Session, *, host: str, origin_host: str, op: str, args: dict[str, Any]) -> int:
    """Write a pending request for ``host`` and wake it at commit: the request's id."""
    row = ClusterRequest(host=host, origin_host=origin_host, op=op, args=args, state=PENDING)
    db.add(row)
    db.flush()
    notify(db, REQUESTS_CHANNEL, host)
    return int(row.id)


def claim(db: Session, host: str) -> Request | None:
    """This host's oldest pending request, marked ``running`` (the caller commits), or None. A row
    another transaction holds is skipped, never waited for."""
    row = db.scalars(
        select(ClusterRequest)
        .where(ClusterRequest.host == host, ClusterRequest.state == PENDING)
        .order_by(ClusterRequest.id)
        .limit(1)
        .with_for_update(skip_locked=True)
    ).first()
    if row is None:
        return None
    row.state = RUNNING
    row.claimed_at = utcnow()
    return Request(int(row.id), row.origin_host, row.op, dict(row.args or {}))


def finish(db: Session, request_id: int, *, result: dict[str, Any] | None = None,
           error: dict[str, Any] | None = None) -> bool:
    """Answer a ``running`` request and wake its requester at commit; False if it is not running."""
    done = _changed(db, update(ClusterRequest)
                    .where(ClusterRequest.id == request_id, ClusterRequest.state == RUNNING)
                    .values(state=DONE, result=result, error=error, done_at=utcnow()))
    if done:
        notify(db, RESULTS_CHANNEL, str(request_id))
    return bool(done)


def give_up(db: Session, request_id: int, error: dict[str, Any]) -> bool:
    """The requester stops waiting for a request nobody claimed: it is answered with ``error`` and
    never run. False when it was claimed already (it runs, or ran)."""
    return bool(_changed(db, update(ClusterRequest)
                         .where(ClusterRequest.id == request_id, ClusterRequest.state == PENDING)
                         .values(state=DONE, error=error, done_at=utcnow())))


def answer_interrupted(db: Session, host: str) -> list[int]:
    """At this host's start: every request it had claimed and not answered (its backend died
    meanwhile) is answered ``request_interrupted``, never run again. Their ids."""
    ids = list(db.scalars(select(ClusterRequest.id).where(ClusterRequest.host == host,
                                                          ClusterRequest.state == RUNNING)
                          .with_for_update()))
    for request_id in ids:
        row = db.get(ClusterRequest, request_id)
        assert row is not None
        error = {"code": REQUEST_INTERRUPTED, "retryable": False,
                 "message": f"host {host}'s backend stopped while it carried out {row.op} (request {request_id}):"
                            " it may or may not have taken effect; kandev session show tells, then ask again"}
        row.state, row.error, row.done_at = DONE, error, utcnow()
        notify(db, RESULTS_CHANNEL, str(request_id))
    return [int(i) for i in ids]


def outcome(db: Session, request_id: int) -> Outcome | None:
    """Where a request stands, as its requester reads it; None for an unknown id."""
    row = db.get(ClusterRequest, request_id, populate_existing=True)
    if row is None:
        return None
    return Outcome(row.state, row.result, row.error)


def forget_done(db: Session, older_than_s: float) -> int:
    """Remove answered requests older than ``older_than_s`` seconds (nobody waits for them): how many."""
    cutoff = utcnow() - timedelta(seconds=older_than_s)
    return _changed(db, delete(ClusterRequest).where(ClusterRequest.state == DONE, ClusterRequest.done_at < cutoff))
