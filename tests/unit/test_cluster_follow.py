"""Following a session of another cluster host (Issue 47 item 3): the owner's commits NOTIFY
``kandev_transcript`` with the session, only once committed; and a ``follow`` stream whose store is
unreachable for a round (a PostgreSQL restart, Issue 47 scenario C) reads again from where it stood,
every entry once and in order, instead of ending."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from daemon.backend.cluster.listener import announce_transcript_commits
from daemon.backend.cluster.requests import TRANSCRIPT_CHANNEL
from daemon.backend.state.events import apply_events, apply_turn_outcome, mark_replaying
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views import follow
from daemon.store import transcript
from daemon.store.db import Store, sqlite_url
from daemon.store.models import Task, TaskSession, Turn
from daemon.store.reach import ReachWatch
from ipc.client import Event
from tests.support.aio import run
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TASK = "7a5c" + "0" * 28
SID = "5e55" + "0" * 28


def _session(store: Store) -> None:
    with store.session() as db:
        db.add(Task(id=TASK, title="t"))
        db.flush()
        db.add(TaskSession(id=SID, task_id=TASK, agent="mock", state="RUNNING", host="b"))
        db.flush()
        db.add(Turn(id="i:1", session_id=SID, ordinal=1, prompt="/slow 3", state="open"))


def _say(store: Store, *texts: str, seq: list[int] = [0]) -> None:  # noqa: B006 (a counter across calls)
    with store.session() as db:
        writer = transcript.TranscriptWriter(db, SID)
        for t in texts:
            seq[0] += 1
            writer.append(turn_id="i:1", role="agent", kind="agent_message_chunk", text=t, instance_id="i1",
                          event_seq=seq[0])


def test_a_commit_that_changes_a_transcript_notifies_its_session_once_committed(pg_store):
    """Issue 47 item 3: the owner's transaction that writes a session's chunks or turn sends
    ``kandev_transcript`` with the session id when it commits; a rolled-back one sends nothing."""
    hub = TranscriptHub()
    hub.observe(pg_store)
    announce_transcript_commits(pg_store)
    url = make_url(str(pg_store.engine.url))
    with psycopg.connect(host=url.query["host"], user=url.username, dbname=url.database, autocommit=True) as conn:
        conn.execute(f"LISTEN {TRANSCRIPT_CHANNEL}")
        _session(pg_store)
        assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == [SID]
        _say(pg_store, "1/3 ", "2/3 ")
        assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == [SID]
        with pytest.raises(RuntimeError), pg_store.session() as db:
            transcript.TranscriptWriter(db, SID).append(turn_id="i:1", role="agent", kind="agent_message_chunk",
                                                        text="lost", instance_id="i1", event_seq=99)
            raise RuntimeError("rolled back")
        assert list(conn.notifies(timeout=0.5)) == []


class _Client:
    """A follow stream's connection as the handler sees it: what it was sent."""

    def __init__(self) -> None:
        self.events: list[tuple[int, str, Any]] = []

    async def start_stream(self, result: Any) -> None:
        self.result = result

    async def send_event(self, seq: int, kind: str, data: Any) -> None:
        self.events.append((seq, kind, data))


def test_a_round_that_finds_the_store_away_is_read_again_and_nothing_is_lost_or_doubled(tmp_path: Path,
                                                                                       monkeypatch):
    """Issue 47 scenario C (the follower's part): a round fails half-way (its position already moved
    past entries it had not sent); the stream does not end, reads again from where it stood, and
    sends each chunk once, in order, then the turn's end."""
    store = Store.open(sqlite_url(tmp_path / "kandev.db"))
    _session(store)
    _say(store, "1/3 ", "2/3 ")
    hub = TranscriptHub()
    hub.observe(store)
    reach = ReachWatch()  # the store care's: it says when the server answers again
    service = follow.FollowService(store, hub, ExecutionStore(), reach=reach, host="a")
    real_round, failed = service._round, []

    def flaky_round(pos: follow.Position, live: bool, replaying: frozenset[str]) -> follow.Round:
        step = real_round(pos, live, replaying)  # moves pos past what it read
        if not failed:
            failed.append(pos.cursor)
            raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"),
                                   connection_invalidated=True)
        return step

    monkeypatch.setattr(service, "_round", flaky_round)
    client = _Client()

    async def scenario() -> None:
        task = asyncio.create_task(service.op_follow(client, {"session_id": SID}))  # type: ignore[arg-type]
        # the failed round is reported as the server being away
        await asyncio.to_thread(wait_until, lambda: reach.unreachable, 30)
        reach.succeeded()  # as the store's upkeep does once its probe reaches the server
        await asyncio.to_thread(wait_until, lambda: len([e for e in client.events if e[1] == "entry"]) == 2, 30)
        await asyncio.to_thread(_say, store, "3/3 ")
        with store.session() as db:
            turn = db.get(Turn, "i:1")
            assert turn is not None
            turn.state, turn.stop_reason = "finished", "end_turn"
        await asyncio.wait_for(task, 30)

    try:
        run(scenario())
    finally:
        store.close()
    assert failed  # the first round did fail
    assert [e[2]["text"] for e in client.events if e[1] == "entry"] == ["1/3 ", "2/3 ", "3/3 "]
    assert [e[1] for e in client.events][-2:] == ["turn_ended", "end"]


def test_a_turn_closed_by_recovery_before_its_replay_keeps_a_follower_elsewhere_waiting(tmp_path: Path):
    """Issue 47 item 3 (Issue 47 scenario B's "every chunk once, visible from a"): the owner's recovery
    stores the outcome of a turn that ended while it was down before its last events are replayed;
    a follower on another host (none of the owner's memory) sees the turn still open until the
    commit that applies its ``turn_ended`` event, so it gets every chunk, then the end."""
    store = Store.open(sqlite_url(tmp_path / "kandev.db"))
    try:
        _session(store)
        _say(store, "1/3 ")
        with store.session() as db:  # what startup recovery applies on b
            assert apply_turn_outcome(db, SID, "i:1", "end_turn", None)
            mark_replaying(db, SID, {"i:1"})
        with store.session() as db:
            pos, _ = follow.start_position(db, SID, after_seq=None, turn_id=None, follow_all=False)
            first = follow.read_round(db, pos, live=False, host="a")
        assert [(e.kind.value, e.data.get("text")) for e in first.events] == [("entry", "1/3 ")]
        assert not first.done
        _say(store, "2/3 ", "3/3 ")  # b's consumer replays the rest ...
        with store.session() as db:  # ... and, last, the turn's end
            ended = apply_events(db, SID, "i1", [Event(10, "turn_ended", {"turn_id": "i:1", "stop_reason": "end_turn",
                                                                          "error": None})]).ended_turns
            assert ended == [("i:1", "end_turn")]
        with store.session() as db:
            turn = db.get(Turn, "i:1")
            assert turn is not None and not turn.replaying
            rest = follow.read_round(db, pos, live=False, host="a")
        assert [(e.kind.value, e.data.get("text")) for e in rest.events] == [
            ("entry", "2/3 "), ("entry", "3/3 "), ("turn_ended", None), ("end", None)]
    finally:
        store.close()


def test_a_replaying_mark_of_an_earlier_lifetime_is_taken_off(tmp_path: Path):
    """Issue 47 item 3: recovery marks exactly the turns it closes now; a mark left by a backend that
    died before its replay ended is taken off (as its memory was), so no follower waits forever."""
    store = Store.open(sqlite_url(tmp_path / "kandev.db"))
    try:
        _session(store)
        with store.session() as db:
            mark_replaying(db, SID, {"i:1"})
        with store.session() as db:
            mark_replaying(db, SID, set())
        with store.session() as db:
            turn = db.get(Turn, "i:1")
            assert turn is not None and not turn.replaying
    finally:
        store.close()
