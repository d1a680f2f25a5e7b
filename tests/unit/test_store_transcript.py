"""daemon.store.transcript: coalesced chunks, exactly once, every chunk addressed by its cursor, retention,
and the migration of a 0.2.0 ``messages`` table (Issue 24 item 1, Issue 24 item 2)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import create_engine, func, select, text

from daemon.store import transcript
from daemon.store.db import MIGRATIONS_DIR, Store, sqlite_url
from daemon.store.models import Task, TaskSession, TranscriptEntry, TranscriptSession, Turn


def _session(store: Store, turns: int = 1) -> str:
    with store.session() as db:
        task = Task(title="t")
        db.add(task)
        db.flush()
        ts = TaskSession(task_id=task.id, agent="mock")
        db.add(ts)
        db.flush()
        for n in range(1, turns + 1):
            db.add(Turn(id=f"{ts.id}-t{n}", session_id=ts.id, ordinal=n, prompt=f"p{n}"))
        return ts.id


def _flood(store: Store, sid: str, texts: list[str], *, first_seq: int = 1, instance: str = "i1",
           turn: str | None = None, per_commit: int = 7) -> None:
    """Chunks of one turn from one instance, a few per transaction (as event batches arrive)."""
    for start in range(0, len(texts), per_commit):
        with store.session() as db:
            w = transcript.TranscriptWriter(db, sid)
            for i, t in enumerate(texts[start:start + per_commit], start):
                w.append(role="agent", kind="agent_message_chunk", text=t, turn_id=turn or f"{sid}-t1",
                         instance_id=instance, event_seq=first_seq + i)


def _all(store: Store, sid: str, after: int = 0) -> list[transcript.Chunk]:
    with store.session() as db:
        return list(transcript.chunks_after(db, sid, after))


def test_consecutive_chunks_share_an_entry_and_each_keeps_its_cursor(store: Store) -> None:
    """Issue 24 item 1: consecutive chunks of one turn from one agent are one stored entry (text
    appended, first and last seq kept), and each chunk is still addressed in order."""
    sid = _session(store)
    texts = [f"{i}/500 " for i in range(1, 501)]
    _flood(store, sid, texts)
    with store.session() as db:
        rows = db.scalars(select(TranscriptEntry).order_by(TranscriptEntry.cursor)).all()
        assert 1 < len(rows) < 10  # 500 chunks, cut at ENTRY_TEXT_LIMIT characters
        assert all(len(r.text) <= transcript.ENTRY_TEXT_LIMIT for r in rows)
        assert rows[0].first_seq == 1 and rows[-1].last_seq == 500
        assert all(a.last_seq + 1 == b.first_seq and a.last_cursor + 1 == b.cursor for a, b in itertools.pairwise(rows))
    chunks = _all(store, sid)
    assert [c.text for c in chunks] == texts
    assert [c.cursor for c in chunks] == list(range(1, 501))
    assert [c.event_seq for c in chunks] == list(range(1, 501))
    assert {c.turn_id for c in chunks} == {f"{sid}-t1"}
    # from the middle of a stored entry: exactly the chunks after that cursor
    assert [c.text for c in _all(store, sid, after=123)] == texts[123:]
    with store.session() as db:
        back = list(transcript.chunks_backward(db, sid))
        assert [c.text for c in back] == texts[::-1]
        assert transcript.count(db, sid) == 500 and transcript.last_cursor(db, sid) == 500


def test_a_replayed_event_is_recognised_and_stored_once(store: Store) -> None:
    """Issue 24 item 1: exactly once stays provable: an event whose seq an entry covers is skipped,
    in a later transaction too."""
    sid = _session(store)
    _flood(store, sid, ["a", "b", "c", "d"])
    _flood(store, sid, ["b", "c", "d", "e"], first_seq=2)  # a replay of 2..4, then 5
    with store.session() as db:
        w = transcript.TranscriptWriter(db, sid)
        assert w.covered("i1", 3) and w.covered("i1", 5) and not w.covered("i1", 6)
        assert w.append(role="agent", kind="agent_message_chunk", text="c", instance_id="i1", event_seq=3) is None
    assert [c.text for c in _all(store, sid)] == ["a", "b", "c", "d", "e"]


def test_what_breaks_a_run_starts_a_new_entry(store: Store) -> None:
    """Another kind, turn, instance or a gap in seqs is a new entry; the cursors stay consecutive."""
    sid = _session(store, turns=2)
    with store.session() as db:
        w = transcript.TranscriptWriter(db, sid)
        w.append(role="agent", kind="agent_message_chunk", text="a", turn_id=f"{sid}-t1", instance_id="i1", event_seq=1)
        w.append(role="agent", kind="agent_thought_chunk", text="b", turn_id=f"{sid}-t1", instance_id="i1", event_seq=2)
        w.append(role="agent", kind="agent_thought_chunk", text="c", turn_id=f"{sid}-t2", instance_id="i1", event_seq=3)
        w.append(role="agent", kind="agent_thought_chunk", text="d", turn_id=f"{sid}-t2", instance_id="i1", event_seq=5)
        w.append(role="agent", kind="agent_thought_chunk", text="e", turn_id=f"{sid}-t2", instance_id="i2", event_seq=6)
        w.append(role="system", kind="note", text="f")
        w.append(role="system", kind="note", text="g")
    with store.session() as db:
        assert db.scalar(select(func.count()).select_from(TranscriptEntry)) == 7
    chunks = _all(store, sid)
    assert [(c.cursor, c.text, c.turn_id) for c in chunks] == [
        (1, "a", f"{sid}-t1"), (2, "b", f"{sid}-t1"), (3, "c", f"{sid}-t2"), (4, "d", f"{sid}-t2"),
        (5, "e", f"{sid}-t2"), (6, "f", None), (7, "g", None)]


def test_cursors_are_per_session_and_never_reused_after_retention(store: Store) -> None:
    """Issue 24 item 2: retention removes old entries; cursors handed out are not handed out again."""
    a, b = _session(store), _session(store)
    _flood(store, a, ["x", "y"])
    _flood(store, b, ["p"], instance="i2", turn=f"{b}-t1")
    with store.session() as db:
        gone = transcript.delete_older_than(db, datetime.now(UTC) + timedelta(seconds=1))
    assert gone == 3 and _all(store, a) == []
    _flood(store, a, ["z"], first_seq=3)
    assert [(c.cursor, c.text) for c in _all(store, a)] == [(3, "z")]
    with store.session() as db:
        assert db.scalar(select(TranscriptSession.last_cursor).where(TranscriptSession.session_id == b)) == 1


def _alembic(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def test_migration_keeps_every_chunk_and_its_cursor(tmp_path: Path) -> None:
    """Issue 24 item 1: a store with 0.2.0's ``messages`` table is converted: every row a chunk with
    its old id as cursor, runs coalesced, turn ids kept, nothing lost."""
    url = sqlite_url(tmp_path / "old.db")
    engine = create_engine(url)
    with engine.begin() as conn:
        cfg = _alembic(url)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
        now = datetime(2026, 1, 1)
        conn.execute(text("INSERT INTO tasks (id, title, executor, state, interrupted, created_at, updated_at)"
                          " VALUES ('t', 't', 'local', 'backlog', 0, :n, :n)"), {"n": now})
        for sid in ("s1", "s2"):
            conn.execute(text("INSERT INTO task_sessions (id, task_id, agent, state, metadata_json, passthrough,"
                              " created_at, updated_at) VALUES (:s, 't', 'mock', 'RUNNING', '{}', 0, :n, :n)"),
                         {"s": sid, "n": now})
        conn.execute(text("INSERT INTO turns (id, session_id, ordinal, prompt, state, started_at)"
                          " VALUES ('turn-1', 's1', 1, '/flood', 'open', :n)"), {"n": now})
        rows = [("s1", "turn-1", "user", "prompt", "/flood", "inst", 1)]
        rows += [("s1", "turn-1", "agent", "agent_message_chunk", f"{i} ", "inst", i + 1) for i in range(1, 6)]
        rows += [("s2", None, "system", "note", "other session", None, None)]  # interleaved: id 7
        rows += [("s1", "turn-1", "agent", "agent_message_chunk", f"{i} ", "inst", i + 1) for i in range(6, 9)]
        rows += [("s1", "turn-lost", "agent", "agent_message_chunk", "orphan", "inst", 10)]
        for sid, tid, role, kind, body, inst, seq in rows:
            conn.execute(text("INSERT INTO messages (session_id, turn_id, role, kind, text, instance_id, event_seq,"
                              " created_at) VALUES (:s, :t, :r, :k, :x, :i, :q, :n)"),
                         {"s": sid, "t": tid, "r": role, "k": kind, "x": body, "i": inst, "q": seq, "n": now})
    engine.dispose()
    store = Store.open(url)  # the backend's own open: migrates to head
    try:
        chunks = _all(store, "s1")
        assert [(c.cursor, c.text, c.turn_id, c.event_seq) for c in chunks] == (
            [(1, "/flood", "turn-1", 1)] + [(i + 1, f"{i} ", "turn-1", i + 1) for i in range(1, 6)]
            + [(i + 2, f"{i} ", "turn-1", i + 1) for i in range(6, 9)] + [(11, "orphan", "turn-lost", 10)])
        assert [(c.cursor, c.text) for c in _all(store, "s2")] == [(7, "other session")]
        with store.session() as db:
            # 1 prompt + one entry for chunks 2..6 + one for 8..10 + the orphan's; the note of s2
            assert db.scalar(select(func.count()).select_from(TranscriptEntry)) == 5
            assert db.get(Turn, "turn-lost").state == "abandoned"
            w = transcript.TranscriptWriter(db, "s1")
            assert w.covered("inst", 10) and not w.covered("inst", 11)
            assert w.append(role="agent", kind="agent_message_chunk", text="new", turn_id="turn-1",
                            instance_id="inst", event_seq=11) == 12
        assert [c.cursor for c in _all(store, "s1", after=9)] == [10, 11, 12]
    finally:
        store.close()


def test_a_reader_sees_an_entry_that_grew_while_it_read(pg_store: Store) -> None:
    """Issue 47 scenario C (a ``follow`` on another host lost chunks): on PostgreSQL each statement
    of a read sees what was committed before it. A writer's commit that grows the last entry and
    starts the next one, falling between two statements of ``chunks_after``, must not hide the
    chunks that grew the entry: every chunk after the reader's cursor comes once, in order."""
    from sqlalchemy import event

    sid = _session(pg_store)
    third = "x" * (transcript.ENTRY_TEXT_LIMIT // 4 - 10)
    texts = [f"{i:03d}{third}" for i in range(1, 7)]
    _flood(pg_store, sid, texts[:3], per_commit=3)  # one entry, chunks 1..3, room for one more
    statements: list[str] = []

    def writer_between_statements(conn: Any, cursor: Any, sql: str, *args: Any) -> None:
        if "transcript_entries" in sql and "FROM" in sql:
            statements.append(sql)
            if len(statements) == 1:  # after the reader's first look at the entries
                _flood(pg_store, sid, texts[3:], first_seq=4, per_commit=3)  # grows the entry, starts the next

    event.listen(pg_store.engine, "after_cursor_execute", writer_between_statements)
    try:
        with pg_store.session() as db:
            got = [c.text for c in transcript.chunks_after(db, sid, 3)]
    finally:
        event.remove(pg_store.engine, "after_cursor_execute", writer_between_statements)
    with pg_store.session() as db:
        entries = db.scalars(select(TranscriptEntry).order_by(TranscriptEntry.cursor)).all()
        assert [(e.cursor, e.last_cursor) for e in entries] == [(1, 4), (5, 6)]  # as the race needs
    assert [t[:3] for t in got] == ["004", "005", "006"] and got == texts[3:]
