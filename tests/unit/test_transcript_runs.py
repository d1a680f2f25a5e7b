"""A run of text chunks is stored as one ``append`` per chunk would store it.

``apply_events`` hands a run of consecutive text chunks (one kind, one turn, consecutive seqs) to
``TranscriptWriter.append_run`` in one call (the backend's CPU per streamed chunk, Issue 24). Here
random event streams, cut into random batches with replays, gaps, turn changes, other updates and
chunks long enough to fill entries, go through ``apply_events`` into one store and through one
``TranscriptWriter.append`` per event into another: every stored row must be the same.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from daemon.backend.state.events import apply_events
from daemon.store.db import Store, sqlite_url
from daemon.store.models import TranscriptEntry, TranscriptSession
from daemon.store.transcript import ENTRY_TEXT_LIMIT, TranscriptWriter
from ipc.client import Event
from tests.support.store_rows import new_session

TEXT_ROLES = {"agent_message_chunk": "agent", "agent_thought_chunk": "agent", "user_message_chunk": "user"}


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[Store, Store]]:
    a, b = Store.open(sqlite_url(tmp_path / "a.db")), Store.open(sqlite_url(tmp_path / "b.db"))
    yield a, b
    a.close()
    b.close()


def _stream(rng: random.Random, n: int) -> list[Event]:
    """``n`` session updates: mostly text chunks, sometimes another update, a new turn or a gap."""
    events, seq, turn = [], 0, None
    for _ in range(n):
        seq += 1 if rng.random() > 0.03 else rng.randint(2, 5)  # a gap: events the store never gets
        if rng.random() < 0.02:
            turn = rng.choice([None, "t1", "t2", "t3", 7])
        roll = rng.random()
        if roll < 0.05:
            update: dict[str, Any] = {"sessionUpdate": "tool_call", "toolCallId": f"c{seq}", "title": "ls"}
        else:
            kind = "agent_message_chunk" if roll < 0.8 else rng.choice(sorted(TEXT_ROLES))
            size = rng.choice([0, 1, 5, 13, 300, ENTRY_TEXT_LIMIT - 3, ENTRY_TEXT_LIMIT + 10])
            update = {"sessionUpdate": kind, "content": {"type": "text", "text": f"{seq}:" + "x" * size}}
        events.append(Event(seq, "session_update", {"turn_id": turn, "update": update}))
    return events


def _batches(rng: random.Random, events: list[Event]) -> Iterator[list[Event]]:
    """The stream in batches of 1 to 60 events; now and then a batch starts with a replay of
    events already sent (a re-attach after a lost stream)."""
    start = 0
    while start < len(events):
        end = min(len(events), start + rng.randint(1, 60))
        replay = rng.randint(1, min(start, 20)) if start and rng.random() < 0.2 else 0
        yield events[start - replay:end]
        start = end


def _one_append_each(store: Store, session_id: str, events: list[Event]) -> None:
    """What ``apply_events`` stores, written the plain way: one ``append`` per event."""
    with store.session() as db:
        writer = TranscriptWriter(db, session_id)
        for ev in events:
            turn = ev.data["turn_id"]
            update = ev.data["update"]
            kind = update["sessionUpdate"]
            if kind in TEXT_ROLES:
                role, text = TEXT_ROLES[kind], update["content"]["text"]
            else:
                role, text = "agent", json.dumps(update, sort_keys=True, default=str)
            writer.append(role=role, kind=kind, text=text, turn_id=None if turn is None else str(turn),
                          instance_id="i1", event_seq=ev.seq)
        writer.flush()


def _rows(store: Store) -> tuple[list[tuple[Any, ...]], int]:
    with store.session() as db:
        entries = db.execute(select(
            TranscriptEntry.cursor, TranscriptEntry.last_cursor, TranscriptEntry.turn, TranscriptEntry.role,
            TranscriptEntry.kind, TranscriptEntry.text, TranscriptEntry.lengths, TranscriptEntry.first_seq,
            TranscriptEntry.last_seq).order_by(TranscriptEntry.cursor)).all()
        last_cursor = db.scalar(select(TranscriptSession.last_cursor))
        return [tuple(row) for row in entries], int(last_cursor or 0)


@pytest.mark.parametrize("seed", range(12))
def test_apply_events_stores_runs_of_chunks_as_one_append_per_chunk_would(stores: tuple[Store, Store], seed: int) -> None:
    bulk, plain = stores
    bulk_sid, plain_sid = new_session(bulk), new_session(plain)
    rng = random.Random(seed)
    events = _stream(rng, 400)
    for batch in _batches(rng, events):
        with bulk.session() as db:
            apply_events(db, bulk_sid, "i1", batch)
        _one_append_each(plain, plain_sid, batch)
    bulk_rows, bulk_cursor = _rows(bulk)
    assert (bulk_rows, bulk_cursor) == _rows(plain)
    assert bulk_cursor == len(events)  # every event once: replays skipped, nothing lost
    assert len(bulk_rows) < len(events)  # and chunks were coalesced


def test_append_run_is_for_text_chunks_only(stores: tuple[Store, Store]) -> None:
    store, _ = stores
    sid = new_session(store)
    with store.session() as db, pytest.raises(ValueError):
        TranscriptWriter(db, sid).append_run(role="agent", kind="tool_call", texts=["x"], turn_id=None,
                                             instance_id="i1", first_seq=1)
