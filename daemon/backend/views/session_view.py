"""What ``kandev session show`` reads from the store: a session, its turns and one transcript page.

A transcript can hold hundreds of thousands of entries (``/flood 100000``), more than one 8 MiB
frame can carry, so ``session show`` pages it:

- no flag: the last ``DEFAULT_PAGE`` entries (old callers that read ``transcript`` see a whole
  transcript of up to that many entries, as before);
- ``tail=N``: the last N entries;
- ``after_seq=S`` (and ``limit=N``, default ``DEFAULT_PAGE``): the first N entries whose
  ``cursor`` is greater than S (``after_seq=0``: from the beginning).

Each entry is one chunk and carries its ``cursor`` (increasing along the session's transcript; the
store coalesces chunks, ``daemon.store.transcript``, but a cursor still names exactly one chunk,
as before, and a cursor from 0.2.0 still names the same chunk); the answer's ``page`` says
where it stands: ``next_cursor`` (pass it as ``after_seq`` for the entries after this page),
``first_cursor``, ``more_before``, ``more_after``, ``count`` and ``total``. Whatever the flags, a
page also stops at ``PAGE_TEXT_BYTES`` of text and an entry's text is cut at ``ENTRY_TEXT_MAX``
characters (``text_truncated`` says so), so an answer always fits in one frame. Turns are the
last ``TURNS_SHOWN`` (``turns_total`` counts all), and permission requests are read from the last
``PERMISSION_MESSAGES`` permission entries.

Everything here is a plain blocking database read: the backend runs it in a worker thread with
its own store session, never on its event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from daemon.store import transcript
from daemon.store.models import ExecutorRunning, TaskSession, Turn
from daemon.store.states import TurnState
from ipc.errors import ErrorCode, IpcError

DEFAULT_PAGE = 10_000
"""Transcript entries of a page when no size is given (also the largest size accepted)."""
MAX_PAGE = DEFAULT_PAGE
PAGE_TEXT_BYTES = 4 * 1024 * 1024
"""Characters of entry text one page carries at most (the frame limit is 8 MiB)."""
ENTRY_TEXT_MAX = 256 * 1024
"""Characters of one entry's (or one turn prompt's) text shown; the rest is cut."""
ENTRY_OVERHEAD = 128
"""Bytes an entry costs besides its text (keys, kind, turn id), counted against the page budget."""
TURNS_SHOWN = 1000
PERMISSION_MESSAGES = 2000
PERMISSION_KINDS = ("permission_request", "permission_response", "permission_cancelled")


@dataclass(frozen=True)
class PageRequest:
    """Which transcript page to read (see the module doc)."""

    tail: int | None = None
    after_seq: int | None = None
    limit: int | None = None

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> PageRequest:
        tail, after, limit = args.get("tail"), args.get("after_seq"), args.get("limit")
        if tail is not None and (after is not None or limit is not None):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "session_show: tail cannot be combined with after_seq/limit")
        for name, value in (("tail", tail), ("limit", limit)):
            if value is not None and not 1 <= value <= MAX_PAGE:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, f"session_show: {name} must be in 1..{MAX_PAGE}, not {value}")
        if after is not None and after < 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"session_show: after_seq must be >= 0, not {after}")
        if limit is not None and after is None:
            after = 0
        return cls(tail=tail, after_seq=after, limit=limit)

    @property
    def forward(self) -> bool:
        return self.after_seq is not None

    @property
    def size(self) -> int:
        return (self.limit if self.forward else self.tail) or DEFAULT_PAGE


def _cut(text: str) -> tuple[str, bool]:
    return (text[:ENTRY_TEXT_MAX], True) if len(text) > ENTRY_TEXT_MAX else (text, False)


def transcript_entry(row: transcript.Chunk) -> dict[str, Any]:
    """One transcript entry (a chunk) as `session show` and `follow` send it (its text cut at ENTRY_TEXT_MAX)."""
    text, cut = _cut(row.text)
    entry = {"role": row.role, "kind": row.kind, "text": text, "turn_id": row.turn_id, "seq": row.event_seq,
             "cursor": row.cursor}
    if cut:
        entry["text_truncated"] = True
    return entry


def transcript_page(db: Session, session_id: str, request: PageRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One page of the transcript in order, and its ``page`` description."""
    after = request.after_seq if request.after_seq is not None else 0
    chunks = (transcript.chunks_after(db, session_id, after) if request.forward
              else transcript.chunks_backward(db, session_id))
    entries: list[dict[str, Any]] = []
    budget = PAGE_TEXT_BYTES
    for chunk in chunks:
        if len(entries) >= request.size:
            break
        entry = transcript_entry(chunk)
        cost = len(entry["text"]) + ENTRY_OVERHEAD
        if entries and cost > budget:
            break  # the page is full: the rest is on the next one
        budget -= cost
        entries.append(entry)
    if not request.forward:
        entries.reverse()
    first = entries[0]["cursor"] if entries else None
    last = entries[-1]["cursor"] if entries else None
    if first is not None and last is not None:
        more_before = transcript.has_before(db, session_id, first)
        more_after = transcript.has_after(db, session_id, last)
    else:
        more_before = request.forward and transcript.has_before(db, session_id, after + 1)
        more_after = False
    page = {
        "mode": "after_seq" if request.forward else "tail",
        "size": request.size,
        "count": len(entries),
        "total": transcript.count(db, session_id),
        "first_cursor": first,
        "next_cursor": last if last is not None else (request.after_seq if request.forward else 0),
        "more_before": more_before,
        "more_after": more_after,
    }
    return entries, page


def permissions(db: Session, session_id: str) -> list[dict[str, Any]]:
    """Permission requests of the transcript (its last ``PERMISSION_MESSAGES`` permission entries),
    each open until answered or cancelled."""
    rows = transcript.last_of_kinds(db, session_id, PERMISSION_KINDS, PERMISSION_MESSAGES)
    requests: dict[str, dict[str, Any]] = {}
    for kind, text in reversed(rows):
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        rid = str(data.get("request_id"))
        if kind == "permission_request":
            options = [o.get("optionId") or o.get("option_id") for o in data.get("options") or []
                       if isinstance(o, dict)]
            requests[rid] = {"request_id": rid, "turn_id": data.get("turn_id"), "options": options,
                             "state": "open", "answer": None}
        elif rid in requests and kind == "permission_cancelled":
            requests[rid]["state"] = "cancelled"
        elif rid in requests:
            requests[rid]["state"] = "answered"
            requests[rid]["answer"] = data.get("option_id")
    _close_with_their_turns(db, session_id, requests)
    return list(requests.values())


def permission_settled(db: Session, session_id: str, request_id: str) -> dict[str, Any] | None:
    """How the session's permission request ``request_id`` was settled, if it was: ``{state:
    answered|cancelled, answer: the option chosen (None: answered as cancelled), reason (of a
    cancellation), at: when}``; None while it is open or unknown."""
    settled = ("permission_response", "permission_cancelled")
    for kind, text, at in transcript.last_of_kinds_at(db, session_id, settled, PERMISSION_MESSAGES):
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict) and str(data.get("request_id")) == request_id:
            return {"state": "answered" if kind == "permission_response" else "cancelled",
                    "answer": data.get("option_id"), "reason": data.get("reason"),
                    "at": at if at.tzinfo is not None else at.replace(tzinfo=UTC)}
    return None


def _close_with_their_turns(db: Session, session_id: str, requests: dict[str, dict[str, Any]]) -> None:
    """A request still open whose turn has ended is ``cancelled``: nothing can answer it any more.
    The agent cancels its open requests itself when a turn is cancelled or it exits, but an agent
    killed with its control server (SIGKILL of the unit) sends nothing, and the interrupted turn's
    request would otherwise stay open for good (Issue 45 scenario A found it)."""
    still_open = {r["turn_id"] for r in requests.values() if r["state"] == "open" and r["turn_id"]}
    if not still_open:
        return
    ended = set(db.scalars(select(Turn.id).where(Turn.session_id == session_id, Turn.id.in_(still_open),
                                                 Turn.state != TurnState.OPEN)))
    for request in requests.values():
        if request["state"] == "open" and request["turn_id"] in ended:
            request["state"] = "cancelled"


def turns(db: Session, session_id: str) -> tuple[list[dict[str, Any]], int]:
    """The last ``TURNS_SHOWN`` turns in order, and how many the session has."""
    rows = db.scalars(
        select(Turn).where(Turn.session_id == session_id).order_by(Turn.ordinal.desc()).limit(TURNS_SHOWN)
    ).all()
    shown = []
    for t in reversed(rows):
        prompt, cut = _cut(t.prompt)
        turn: dict[str, Any] = {"turn_id": t.id, "state": t.state, "stop_reason": t.stop_reason, "prompt": prompt}
        if cut:
            turn["prompt_truncated"] = True
        if t.error:  # why it failed or was interrupted (e.g. the backend stopped and survival is off)
            turn["error"] = t.error
        shown.append(turn)
    total = db.execute(select(func.count()).select_from(Turn).where(Turn.session_id == session_id)).scalar()
    return shown, int(total or 0)


@dataclass
class StoredSession:
    """The store's part of ``session show`` (the backend adds what only it knows in memory)."""

    session: TaskSession
    row: ExecutorRunning | None
    turns: list[dict[str, Any]]
    turns_total: int
    transcript: list[dict[str, Any]]
    page: dict[str, Any]
    permissions: list[dict[str, Any]]


def read_session(db: Session, session_id: str, request: PageRequest) -> StoredSession | None:
    """Everything ``session show`` reads from the store; None for an unknown session."""
    session = db.get(TaskSession, session_id)
    if session is None:
        return None
    shown_turns, turns_total = turns(db, session_id)
    transcript, page = transcript_page(db, session_id, request)
    return StoredSession(
        session=session,
        row=db.get(ExecutorRunning, session_id),
        turns=shown_turns,
        turns_total=turns_total,
        transcript=transcript,
        page=page,
        permissions=permissions(db, session_id),
    )
