"""The lean transcript: chunks coalesced into entries, addressed one chunk at a time by cursor.

What clients see has not changed: a session's transcript is a list of chunks (a prompt, an agent
message chunk, a tool call, a note), each with a ``cursor`` that grows along the transcript and
the ``seq`` of the event it came from. ``session show`` pages by cursor and ``follow`` resumes
after one (docs/architecture.md#the-store).

What is stored is leaner (Issue 24 item 1). Consecutive text chunks (``CHUNK_KINDS``) of one turn
from one agent instance, with consecutive event seqs, are appended to one ``TranscriptEntry``
until it holds ``ENTRY_TEXT_LIMIT`` characters: the entry keeps the cursors and the event seqs of
its first and last chunk (both consecutive inside an entry) and the chunks' lengths (``lengths``,
LEB128 varints), so every chunk can be cut back out. Ids that rows would repeat are compact
integers: the session and the instance through ``transcript_sessions`` / ``transcript_instances``,
the turn as its ordinal in the session.

Cursors are per session: ``transcript_sessions.last_cursor`` is the last one handed out (kept
even when retention removes entries, so a cursor is never reused). A store migrated from 0.2.0
keeps every chunk's cursor (the old row id); new chunks continue after the session's largest.

Exactly-once: an event's chunk is written only if no entry of its instance covers its seq yet
(``first_seq <= seq <= last_seq``); a replayed event is recognised and skipped, so a transcript
never holds an event twice.

Writers hold the session's ``transcript_sessions`` row locked for the rest of the transaction (an
``UPDATE`` before reading it), so two writers of one session never hand out the same cursor.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Table, Text, bindparam, delete, event, func, insert, select, update
from sqlalchemy.orm import Session

from daemon.store.models import TranscriptEntry, TranscriptInstance, TranscriptSession, Turn

# The statements every batch of a streaming session runs, built once on the tables (Core): one
# built per call, through the ORM, cost more CPU than running it (construction, cache keys, the
# ORM's bulk machinery: ~60% of a batch's CPU). They bind their values by name.
_SESSIONS = cast(Table, TranscriptSession.__table__)
_ENTRIES = cast(Table, TranscriptEntry.__table__)
_LOCK_TAIL = (update(_SESSIONS).where(_SESSIONS.c.session_id == bindparam("sid"))
              .values(last_cursor=_SESSIONS.c.last_cursor).returning(_SESSIONS.c.key, _SESSIONS.c.last_cursor))
_EXTEND_ENTRY = (update(_ENTRIES)
                 .where(_ENTRIES.c.session_key == bindparam("skey"), _ENTRIES.c.cursor == bindparam("ecursor"))
                 .values(text=_ENTRIES.c.text + bindparam("more", type_=Text()), lengths=bindparam("elengths"),
                         last_cursor=bindparam("elast"), last_seq=bindparam("eseq")))
_INSERT_ENTRIES = insert(_ENTRIES)
_SET_LAST_CURSOR = update(_SESSIONS).where(_SESSIONS.c.key == bindparam("skey")).values(last_cursor=bindparam("cur"))

CHUNK_KINDS = frozenset({"agent_message_chunk", "agent_thought_chunk", "user_message_chunk"})
"""Entry kinds whose consecutive chunks are coalesced."""
ENTRY_TEXT_LIMIT = 2000
"""Characters an entry grows to by coalescing (a row stays inside one 4 KiB SQLite page)."""
TOUCHED = "kandev_transcript_touched"
"""``Session.info`` key: ids of the sessions whose transcript or turns this transaction changed."""
_READ_BATCH = 256


def _now() -> datetime:
    return datetime.now(UTC)


def encode_lengths(lengths: Iterable[int]) -> bytes:
    """Chunk lengths as LEB128 varints."""
    out = bytearray()
    for n in lengths:
        while True:
            low = n & 0x7F
            n >>= 7
            if n:
                out.append(low | 0x80)
            else:
                out.append(low)
                break
    return bytes(out)


def decode_lengths(data: bytes) -> list[int]:
    lengths: list[int] = []
    n = shift = 0
    for byte in data:
        n |= (byte & 0x7F) << shift
        if byte & 0x80:
            shift += 7
        else:
            lengths.append(n)
            n = shift = 0
    return lengths


def touch(db: Session, session_id: str) -> None:
    """Note that this transaction changed the session's transcript (``TranscriptHub`` wakes its followers)."""
    db.info.setdefault(TOUCHED, set()).add(session_id)


def ensure_turn(db: Session, session_id: str, turn_id: str, prompt: str | None) -> Turn:
    """The session's turn ``turn_id``, created open (with the next ordinal) if the store has none yet."""
    turn = db.get(Turn, turn_id)
    if turn is None:
        ordinal = db.scalar(select(func.max(Turn.ordinal)).where(Turn.session_id == session_id)) or 0
        turn = Turn(id=turn_id, session_id=session_id, ordinal=ordinal + 1, prompt=prompt or "", state="open",
                    started_at=_now())
        db.add(turn)
        db.flush()
    elif prompt and not turn.prompt:
        turn.prompt = prompt
    return turn


@dataclass
class _Entry:
    """The newest entry of a session as the writer sees it (what is stored plus what is pending)."""

    cursor: int
    last_cursor: int
    kind: str
    role: str
    turn: int | None
    instance_key: int | None
    first_seq: int | None
    last_seq: int | None
    text_len: int
    lengths: list[int]
    created_at: datetime
    stored: bool  # the row exists (else it is inserted at flush)
    parts: list[str] = field(default_factory=list)  # text appended since the last flush

    def copy(self) -> _Entry:
        return replace(self, lengths=list(self.lengths), parts=list(self.parts))

    def add(self, text: str, cursor: int, seq: int | None) -> None:
        """Append a chunk to this entry: ``text`` is chunk ``cursor``, of event ``seq``."""
        self.parts.append(text)
        self.text_len += len(text)
        self.lengths.append(len(text))
        self.last_cursor = cursor
        self.last_seq = seq


@dataclass
class _Tail:
    """What one session's writer knows after its last commit: cached between transactions (keyed
    by the session's ``last_cursor``), so a batch costs one locking ``UPDATE ... RETURNING``, the
    entry's ``UPDATE`` or ``INSERT`` and the cursor's ``UPDATE``."""

    key: int
    last_cursor: int
    entry: _Entry | None
    instances: dict[str, tuple[int, int]] = field(default_factory=dict)  # id -> (key, last seq written)
    turns: dict[str, int] = field(default_factory=dict)  # turn id -> ordinal

    def copy(self) -> _Tail:
        return _Tail(self.key, self.last_cursor, self.entry.copy() if self.entry else None, dict(self.instances),
                     dict(self.turns))


_TAILS: weakref.WeakKeyDictionary[Any, dict[str, _Tail]] = weakref.WeakKeyDictionary()
_PENDING = "kandev_transcript_pending"  # Session.info: tails to cache once the transaction commits
_WRITERS = "kandev_transcript_writers"  # Session.info: writers with unflushed chunks
_FORGET = "kandev_transcript_forget"  # Session.info: drop the cache at commit (entries were deleted)


def _tails(db: Session) -> dict[str, _Tail]:
    engine = db.get_bind()
    tails = _TAILS.get(engine)
    if tails is None:
        tails = _TAILS[engine] = {}
    return tails


@event.listens_for(Session, "before_commit")
def _flush_writers(db: Session) -> None:
    for writer in list(db.info.get(_WRITERS, ())):
        writer.flush()


@event.listens_for(Session, "after_commit")
def _cache_tails(db: Session) -> None:
    pending = db.info.pop(_PENDING, None)
    db.info.pop(_WRITERS, None)
    if db.info.pop(_FORGET, False):
        _tails(db).clear()
    elif pending:
        _tails(db).update(pending)


@event.listens_for(Session, "after_rollback")
def _drop_pending(db: Session) -> None:
    for key in (_PENDING, _WRITERS, _FORGET):
        db.info.pop(key, None)


class TranscriptWriter:
    """Appends chunks to one session's transcript in the caller's transaction (see the module doc).

    Chunks are buffered and written by ``flush()`` (called by ``append``'s helper, by
    ``apply_events`` and, for any writer left unflushed, before the transaction commits)."""

    def __init__(self, db: Session, session_id: str) -> None:
        self.db = db
        self.session_id = session_id
        self._tail: _Tail | None = None
        self._stored: _Entry | None = None
        self._new: list[_Entry] = []  # entries to insert at flush, oldest first
        self._dirty = False

    def _open(self) -> _Tail:
        if self._tail is not None:
            return self._tail
        db = self.db
        # Lock the row first (a write), then read it: no other writer hands out our cursors.
        row = db.execute(_LOCK_TAIL, {"sid": self.session_id}).first()
        if row is None:
            key = db.execute(insert(TranscriptSession).values(session_id=self.session_id, last_cursor=0)
                             .returning(TranscriptSession.key)).scalar_one()
            tail = _Tail(key, 0, None)
        else:
            cached = _tails(db).get(self.session_id)
            if cached is not None and cached.key == row.key and cached.last_cursor == row.last_cursor:
                tail = cached.copy()
            else:
                tail = _Tail(row.key, row.last_cursor, self._load_last(row.key))
        self._tail = tail
        self._stored = tail.entry  # the stored entry this transaction may extend
        return tail

    def _load_last(self, key: int) -> _Entry | None:
        last = self.db.execute(select(*_COLUMNS, TranscriptEntry.instance_key, TranscriptEntry.last_seq)
                               .where(TranscriptEntry.session_key == key)
                               .order_by(TranscriptEntry.cursor.desc()).limit(1)).first()
        if last is None:
            return None
        lengths = decode_lengths(last.lengths) if last.lengths else [len(last.text)]
        return _Entry(last.cursor, last.last_cursor, last.kind, last.role, last.turn, last.instance_key,
                      last.first_seq, last.last_seq, len(last.text), lengths, last.created_at, stored=True)

    def _instance(self, instance_id: str) -> tuple[int, int]:
        tail = self._open()
        known = tail.instances.get(instance_id)
        if known is None:
            db = self.db
            key = db.scalar(select(TranscriptInstance.key).where(TranscriptInstance.instance_id == instance_id))
            if key is None:
                key = db.execute(insert(TranscriptInstance).values(instance_id=instance_id, session_key=tail.key)
                                 .returning(TranscriptInstance.key)).scalar_one()
                applied = 0
            else:
                applied = db.scalar(select(func.max(TranscriptEntry.last_seq))
                                    .where(TranscriptEntry.instance_key == key)) or 0
            known = tail.instances[instance_id] = (key, applied)
        return known

    def covered(self, instance_id: str, seq: int) -> bool:
        """Whether the transcript already holds event ``seq`` of the instance (events are written in
        seq order, so what is covered is a prefix of the instance's seqs)."""
        return seq <= self._instance(instance_id)[1]

    def append(self, *, role: str, kind: str, text: str, turn_id: str | None = None,
               instance_id: str | None = None, event_seq: int | None = None,
               created_at: datetime | None = None) -> int | None:
        """Append one chunk; its cursor, or None if its event is already in the transcript."""
        tail = self._open()
        instance_key: int | None = None
        if instance_id is not None:
            instance_key, applied = self._instance(instance_id)
            if event_seq is not None:
                if event_seq <= applied:
                    return None  # a replayed event: already stored
                tail.instances[instance_id] = (instance_key, event_seq)
        turn = self._turn(tail, turn_id)
        cursor = tail.last_cursor + 1
        tail.last_cursor = cursor
        last = tail.entry
        if (kind in CHUNK_KINDS and last is not None and last.kind == kind and last.role == role
                and last.turn == turn and instance_key is not None and last.instance_key == instance_key
                and event_seq is not None and last.last_seq is not None and event_seq == last.last_seq + 1
                and last.last_cursor == cursor - 1 and last.text_len + len(text) <= ENTRY_TEXT_LIMIT):
            last.add(text, cursor, event_seq)
        else:
            self._start(tail, cursor, kind, role, turn, instance_key, event_seq, text, created_at)
        self._mark_dirty()
        return cursor

    def append_run(self, *, role: str, kind: str, texts: list[str], turn_id: str | None, instance_id: str,
                   first_seq: int, created_at: datetime | None = None) -> None:
        """``append`` for a run of chunks of one kind (one of ``CHUNK_KINDS``), role and turn from
        one instance, whose events are ``first_seq``, ``first_seq + 1``, ...: the same entries and
        cursors as one ``append`` each, with the run's checks made once. Chunks whose events the
        transcript already holds (a replay: a prefix of the run) are skipped."""
        if kind not in CHUNK_KINDS:
            raise ValueError(f"append_run is for text chunks ({sorted(CHUNK_KINDS)}), not {kind!r}")
        tail = self._open()
        instance_key, applied = self._instance(instance_id)
        if applied >= first_seq:
            texts = texts[applied - first_seq + 1:]
            first_seq = applied + 1
        if not texts:
            return
        seq = first_seq - 1
        tail.instances[instance_id] = (instance_key, seq + len(texts))
        turn = self._turn(tail, turn_id)
        cursor = tail.last_cursor
        last = tail.entry
        extend = (last is not None and last.kind == kind and last.role == role and last.turn == turn
                  and last.instance_key == instance_key and last.last_seq is not None
                  and first_seq == last.last_seq + 1 and last.last_cursor == cursor)
        for text in texts:
            cursor += 1
            seq += 1
            if extend and last is not None and last.text_len + len(text) <= ENTRY_TEXT_LIMIT:
                last.add(text, cursor, seq)
            else:
                last = self._start(tail, cursor, kind, role, turn, instance_key, seq, text, created_at)
                extend = True
        tail.last_cursor = cursor
        self._mark_dirty()

    def _start(self, tail: _Tail, cursor: int, kind: str, role: str, turn: int | None, instance_key: int | None,
               seq: int | None, text: str, created_at: datetime | None) -> _Entry:
        """A new newest entry holding one chunk (``text``, chunk ``cursor``, of event ``seq``)."""
        entry = _Entry(cursor, cursor, kind, role, turn, instance_key, seq, seq, len(text), [len(text)],
                       created_at or _now(), stored=False, parts=[text])
        tail.entry = entry
        self._new.append(entry)
        return entry

    def _turn(self, tail: _Tail, turn_id: str | None) -> int | None:
        """The ordinal of turn ``turn_id`` (the turn is created if the store has none yet)."""
        if turn_id is None:
            return None
        turn = tail.turns.get(turn_id)
        if turn is None:
            turn = tail.turns[turn_id] = ensure_turn(self.db, self.session_id, turn_id, None).ordinal
        return turn

    def _mark_dirty(self) -> None:
        if not self._dirty:
            self._dirty = True
            self.db.info.setdefault(_WRITERS, []).append(self)

    def flush(self) -> None:
        """Write what ``append`` buffered (in the caller's transaction)."""
        if not self._dirty or self._tail is None:
            return
        db, tail = self.db, self._tail
        last = self._stored
        if last is not None and last.parts:
            done = db.execute(_EXTEND_ENTRY, {"skey": tail.key, "ecursor": last.cursor, "more": "".join(last.parts),
                                              "elengths": encode_lengths(last.lengths), "elast": last.last_cursor,
                                              "eseq": last.last_seq})
            if done.rowcount != 1:  # type: ignore[attr-defined]
                raise RuntimeError(f"transcript of session {self.session_id}: entry {last.cursor} vanished")
        if self._new:
            db.execute(_INSERT_ENTRIES, [
                {"session_key": tail.key, "cursor": e.cursor, "last_cursor": e.last_cursor, "turn": e.turn,
                 "role": e.role, "kind": e.kind, "text": "".join(e.parts),
                 "lengths": encode_lengths(e.lengths) if len(e.lengths) > 1 else None,
                 "instance_key": e.instance_key, "first_seq": e.first_seq, "last_seq": e.last_seq,
                 "created_at": e.created_at} for e in self._new])
        for e in self._new:
            e.stored = True
            e.parts.clear()
        if last is not None:
            last.parts.clear()
        self._new.clear()
        self._stored = tail.entry
        db.execute(_SET_LAST_CURSOR, {"skey": tail.key, "cur": tail.last_cursor})
        self._dirty = False
        writers = db.info.get(_WRITERS)
        if writers is not None and self in writers:
            writers.remove(self)
        db.info.setdefault(_PENDING, {})[self.session_id] = tail.copy()
        touch(db, self.session_id)


def append(db: Session, session_id: str, *, role: str, kind: str, text: str, turn_id: str | None = None,
           instance_id: str | None = None, event_seq: int | None = None,
           created_at: datetime | None = None) -> int | None:
    """Append one chunk (see ``TranscriptWriter.append``) and write it."""
    writer = TranscriptWriter(db, session_id)
    cursor = writer.append(role=role, kind=kind, text=text, turn_id=turn_id, instance_id=instance_id,
                           event_seq=event_seq, created_at=created_at)
    writer.flush()
    return cursor


# -- reading ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One transcript chunk as clients address it."""

    cursor: int
    role: str
    kind: str
    text: str
    turn_id: str | None
    event_seq: int | None
    created_at: datetime | None


def session_key(db: Session, session_id: str) -> int | None:
    return db.scalar(select(TranscriptSession.key).where(TranscriptSession.session_id == session_id))


def _split(entry: Any, turn_id: str | None) -> list[Chunk]:
    if entry.lengths is None:
        return [Chunk(entry.cursor, entry.role, entry.kind, entry.text, turn_id, entry.first_seq, entry.created_at)]
    chunks = []
    offset = 0
    for i, n in enumerate(decode_lengths(entry.lengths)):
        seq = entry.first_seq + i if entry.first_seq is not None else None
        chunks.append(Chunk(entry.cursor + i, entry.role, entry.kind, entry.text[offset:offset + n], turn_id, seq,
                            entry.created_at))
        offset += n
    return chunks


class _Turns:
    """Turn ordinal -> turn id for one session, read as needed."""

    def __init__(self, db: Session, session_id: str) -> None:
        self.db = db
        self.session_id = session_id
        self.ids: dict[int, str] = {}

    def load(self, entries: Sequence[Any]) -> None:
        missing = {e.turn for e in entries if e.turn is not None and e.turn not in self.ids}
        if missing:
            for ordinal, tid in self.db.execute(select(Turn.ordinal, Turn.id).where(
                    Turn.session_id == self.session_id, Turn.ordinal.in_(missing))):
                self.ids[ordinal] = tid

    def of(self, entry: Any) -> str | None:
        return self.ids.get(entry.turn) if entry.turn is not None else None


_COLUMNS = (TranscriptEntry.cursor, TranscriptEntry.last_cursor, TranscriptEntry.turn, TranscriptEntry.role,
            TranscriptEntry.kind, TranscriptEntry.text, TranscriptEntry.lengths, TranscriptEntry.first_seq,
            TranscriptEntry.created_at)


def chunks_after(db: Session, session_id: str, after: int) -> Iterator[Chunk]:
    """The session's chunks with a cursor greater than ``after``, in cursor order (read lazily).

    A writer grows the session's last entry in place (its later chunks coalesce into it) and can
    start the next entry in the same commit. Each read of a batch is its own statement, and on
    PostgreSQL each statement sees every commit made before it (READ COMMITTED), so a read that
    took "entries starting after ``after``" could see the next entry and never the chunks added
    to the one holding ``after``: a ``follow`` on another host lost them (Issue 47 scenario C). So
    every read starts at the entry holding ``after`` and takes the entries that end after it."""
    key = session_key(db, session_id)
    if key is None:
        return
    turns = _Turns(db, session_id)
    start = db.scalar(select(TranscriptEntry.cursor).where(TranscriptEntry.session_key == key,
                                                           TranscriptEntry.cursor <= after)
                      .order_by(TranscriptEntry.cursor.desc()).limit(1))
    while True:
        query = select(*_COLUMNS).where(TranscriptEntry.session_key == key, TranscriptEntry.last_cursor > after)
        if start is not None:
            query = query.where(TranscriptEntry.cursor >= start)
        rows = db.execute(query.order_by(TranscriptEntry.cursor).limit(_READ_BATCH)).all()
        turns.load(rows)
        for row in rows:
            yield from (c for c in _split(row, turns.of(row)) if c.cursor > after)
        if len(rows) < _READ_BATCH:
            return
        start, after = rows[-1].cursor, rows[-1].last_cursor


def chunks_backward(db: Session, session_id: str) -> Iterator[Chunk]:
    """The session's chunks from the last one backwards (read lazily)."""
    key = session_key(db, session_id)
    if key is None:
        return
    turns = _Turns(db, session_id)
    before: int | None = None
    while True:
        query = select(*_COLUMNS).where(TranscriptEntry.session_key == key)
        if before is not None:
            query = query.where(TranscriptEntry.cursor < before)
        rows = db.execute(query.order_by(TranscriptEntry.cursor.desc()).limit(_READ_BATCH)).all()
        turns.load(rows)
        for row in rows:
            yield from reversed(_split(row, turns.of(row)))
        if len(rows) < _READ_BATCH:
            return
        before = rows[-1].cursor


def has_before(db: Session, session_id: str, cursor: int) -> bool:
    """Whether a chunk with a smaller cursor exists."""
    key = session_key(db, session_id)
    return key is not None and db.execute(select(TranscriptEntry.id).where(
        TranscriptEntry.session_key == key, TranscriptEntry.cursor < cursor).limit(1)).first() is not None


def has_after(db: Session, session_id: str, cursor: int) -> bool:
    """Whether a chunk with a greater cursor exists."""
    key = session_key(db, session_id)
    if key is None:
        return False
    last = db.scalar(select(TranscriptEntry.last_cursor).where(TranscriptEntry.session_key == key)
                     .order_by(TranscriptEntry.cursor.desc()).limit(1))
    return last is not None and last > cursor


def count(db: Session, session_id: str) -> int:
    """How many chunks the session's transcript holds."""
    key = session_key(db, session_id)
    if key is None:
        return 0
    total = db.scalar(select(func.sum(TranscriptEntry.last_cursor - TranscriptEntry.cursor + 1))
                      .where(TranscriptEntry.session_key == key))
    return int(total or 0)


def last_cursor(db: Session, session_id: str) -> int:
    """The cursor of the session's last stored chunk (0 if none)."""
    key = session_key(db, session_id)
    if key is None:
        return 0
    last = db.scalar(select(TranscriptEntry.last_cursor).where(TranscriptEntry.session_key == key)
                     .order_by(TranscriptEntry.cursor.desc()).limit(1))
    return int(last or 0)


def first_cursor_of_turn(db: Session, session_id: str, turn_id: str) -> int | None:
    """The cursor of the turn's first chunk, None if it has none."""
    turn = db.get(Turn, turn_id)
    key = session_key(db, session_id)
    if turn is None or key is None:
        return None
    return db.scalar(select(func.min(TranscriptEntry.cursor)).where(TranscriptEntry.session_key == key,
                                                                    TranscriptEntry.turn == turn.ordinal))


def last_of_kinds(db: Session, session_id: str, kinds: Iterable[str], limit: int) -> list[tuple[str, str]]:
    """(kind, text) of the session's last ``limit`` entries of these (never coalesced) kinds, newest first."""
    key = session_key(db, session_id)
    if key is None:
        return []
    return [(k, t) for k, t in db.execute(
        select(TranscriptEntry.kind, TranscriptEntry.text)
        .where(TranscriptEntry.session_key == key, TranscriptEntry.kind.in_(list(kinds)))
        .order_by(TranscriptEntry.cursor.desc()).limit(limit))]


def last_of_kinds_at(db: Session, session_id: str, kinds: Iterable[str], limit: int) -> list[tuple[str, str, datetime]]:
    """``last_of_kinds`` with the moment each entry was written."""
    key = session_key(db, session_id)
    if key is None:
        return []
    return [(k, t, at) for k, t, at in db.execute(
        select(TranscriptEntry.kind, TranscriptEntry.text, TranscriptEntry.created_at)
        .where(TranscriptEntry.session_key == key, TranscriptEntry.kind.in_(list(kinds)))
        .order_by(TranscriptEntry.cursor.desc()).limit(limit))]


def delete_older_than(db: Session, cutoff: datetime) -> int:
    """Retention: remove every entry written before ``cutoff``; returns how many chunks went.
    Cursors are not reused (``transcript_sessions.last_cursor`` stays)."""
    old = TranscriptEntry.created_at < cutoff
    doomed = db.execute(select(TranscriptEntry.session_key,
                               func.sum(TranscriptEntry.last_cursor - TranscriptEntry.cursor + 1))
                        .where(old).group_by(TranscriptEntry.session_key)).all()
    if not doomed:
        return 0
    db.execute(delete(TranscriptEntry).where(old))
    db.info[_FORGET] = True  # the cached newest entries may be gone
    keys = [k for k, _ in doomed]
    for (sid,) in db.execute(select(TranscriptSession.session_id).where(TranscriptSession.key.in_(keys))):
        touch(db, sid)
    return int(sum(n for _, n in doomed))
