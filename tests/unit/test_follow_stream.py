"""daemon.backend.views.follow and transcript_hub: what a ``follow`` stream sends, in which order, and
when it wakes (Issue 14 scenario C and Issue 14 scenario D rest on these rules; the real streams are in
tests/integration/test_cli_human.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.follow import FollowEvent, Position, read_round, start_position
from daemon.store import transcript
from daemon.store.db import Store, sqlite_url
from daemon.store.models import Task, TaskSession, TranscriptEntry, Turn
from ipc.errors import ErrorCode, IpcError

SID = "5e55" + "0" * 28


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(sqlite_url(tmp_path / "kandev.db"))
    with s.session() as db:
        db.add(Task(id="7a5c" + "0" * 28, title="t"))
        db.flush()
        db.add(TaskSession(id=SID, task_id="7a5c" + "0" * 28, agent="mock", state="WAITING_FOR_INPUT"))
    yield s
    s.close()


def _turn(store: Store, n: int, prompt: str) -> str:
    tid = f"inst:{n}"
    with store.session() as db:
        db.add(Turn(id=tid, session_id=SID, ordinal=n, prompt=prompt, state="open"))
        db.flush()
        transcript.append(db, SID, turn_id=tid, role="user", kind="prompt", text=prompt)
    return tid


_seqs = itertools.count(1)


def _say(store: Store, turn_id: str | None, *texts: str, kind: str = "agent_message_chunk") -> None:
    """Chunks from one agent instance with consecutive event seqs: the store coalesces them into one
    entry (daemon.store.transcript), and a stream still sees each chunk with its own cursor."""
    with store.session() as db:
        writer = transcript.TranscriptWriter(db, SID)
        for t in texts:
            writer.append(turn_id=turn_id, role="agent", kind=kind, text=t, instance_id="i1", event_seq=next(_seqs))


def _end(store: Store, turn_id: str, stop_reason: str = "end_turn", state: str = "finished") -> None:
    with store.session() as db:
        turn = db.get(Turn, turn_id)
        turn.state, turn.stop_reason = state, stop_reason


def _start(store: Store, **kw) -> tuple[Position, dict]:
    kw.setdefault("after_seq", None)
    kw.setdefault("turn_id", None)
    kw.setdefault("follow_all", False)
    with store.session() as db:
        return start_position(db, SID, **kw)


def _round(store: Store, pos: Position, live: bool = True, **kw) -> tuple[list[tuple[str, object]], bool, bool]:
    with store.session() as db:
        r = read_round(db, pos, live=live, **kw)
    shown = []
    for ev in r.events:
        if ev.kind is FollowEvent.ENTRY:
            shown.append(("entry", ev.data["text"]))
        elif ev.kind is FollowEvent.TURN_ENDED:
            shown.append(("turn_ended", ev.data["stop_reason"]))
        else:
            shown.append(("end", ev.data["reason"]))
    return shown, r.done, r.more


def test_follow_starts_at_the_latest_turn_and_ends_after_its_end(store: Store) -> None:
    t1 = _turn(store, 1, "first")
    _say(store, t1, "old ")
    _end(store, t1)
    t2 = _turn(store, 2, "/slow 3")
    _say(store, t2, "1/3 ")
    pos, result = _start(store)
    assert result["turn_id"] == t2 and result["turn_ordinal"] == 2
    assert _round(store, pos) == ([("entry", "/slow 3"), ("entry", "1/3 ")], False, False)
    assert _round(store, pos) == ([], False, False)  # nothing new: the stream sleeps
    _say(store, t2, "2/3 ", "3/3 ")
    _end(store, t2)
    assert _round(store, pos) == ([("entry", "2/3 "), ("entry", "3/3 "), ("turn_ended", "end_turn"),
                                   ("end", "turn_ended")], True, False)


def test_a_finished_turn_is_replayed_and_the_stream_ends(store: Store) -> None:
    t1 = _turn(store, 1, "hi")
    _say(store, t1, "echo: hi")
    _end(store, t1, "refusal")
    pos, _ = _start(store)
    assert _round(store, pos) == ([("entry", "hi"), ("entry", "echo: hi"), ("turn_ended", "refusal"),
                                   ("end", "turn_ended")], True, False)


def test_a_turn_whose_outcome_recovery_applied_first_waits_for_its_replayed_entries(store: Store) -> None:
    """After a restart recovery applies an outcome that arrived while the backend was away before
    the consumer replays that turn's chunks: the stream counts the turn as open until they are in,
    so it never ends before them (Issue 14 scenario D across a down/up)."""
    t1 = _turn(store, 1, "/slow 3")
    _say(store, t1, "1/3 ")
    _end(store, t1)  # recovery: the outcome first
    pos, _ = _start(store)
    assert _round(store, pos, replaying=frozenset({t1})) == ([("entry", "/slow 3"), ("entry", "1/3 ")], False, False)
    _say(store, t1, "2/3 ", "3/3 ")  # the consumer: the replayed chunks, then the turn leaves the set
    assert _round(store, pos) == ([("entry", "2/3 "), ("entry", "3/3 "), ("turn_ended", "end_turn"),
                                   ("end", "turn_ended")], True, False)


def test_resuming_after_a_cursor_sends_the_rest_exactly_once(store: Store) -> None:
    """What a reconnecting client asks: after_seq = the last cursor it printed, the same turn."""
    t1 = _turn(store, 1, "/slow 4")
    _say(store, t1, "1/4 ", "2/4 ")
    pos, _ = _start(store)
    first, _, _ = _round(store, pos)
    printed = pos.cursor
    _say(store, t1, "3/4 ", "4/4 ")
    _end(store, t1)
    again, _ = _start(store, after_seq=printed, turn_id=t1)
    rest, done, _ = _round(store, again)
    assert [t for _, t in first + rest][:5] == ["/slow 4", "1/4 ", "2/4 ", "3/4 ", "4/4 "] and done


def test_entries_written_after_the_turn_ended_come_after_its_end_line(store: Store) -> None:
    """E.g. an agent that died (the turn abandoned), then a resume note: the turn's end comes before
    the note, and a follow of that turn alone stops there."""
    t1 = _turn(store, 1, "/exit 3")
    _say(store, None, "agent exited with code 3", kind="agent_exited")
    _end(store, t1, "agent_exited", state="abandoned")
    with store.session() as db:
        db.get(Turn, t1).ended_at = datetime.now(UTC)
    _say(store, None, "{}", kind="session_resumed")
    pos, _ = _start(store)
    assert _round(store, pos) == ([("entry", "/exit 3"), ("entry", "agent exited with code 3"),
                                   ("turn_ended", "agent_exited"), ("end", "turn_ended")], True, False)
    pos, _ = _start(store, follow_all=True)
    shown, done, _ = _round(store, pos)
    assert shown == [("entry", "/exit 3"), ("entry", "agent exited with code 3"), ("turn_ended", "agent_exited"),
                     ("entry", "{}")] and not done
    _turn(store, 2, "again")
    _say(store, None, "note")  # after turn 1's end, in turn 2: no second end line for turn 1
    shown, _, _ = _round(store, pos)
    assert shown == [("entry", "again"), ("entry", "note")]


def test_turn_end_waits_for_entries_past_a_full_round(store: Store) -> None:
    t1 = _turn(store, 1, "/flood 5")
    _say(store, t1, *[f"{i}/5 " for i in range(1, 6)])
    _end(store, t1)
    pos, _ = _start(store)
    assert _round(store, pos, limit=4) == ([("entry", "/flood 5")] + [("entry", f"{i}/5 ") for i in range(1, 4)],
                                           False, True)
    assert _round(store, pos, limit=4) == ([("entry", "4/5 "), ("entry", "5/5 "), ("turn_ended", "end_turn"),
                                            ("end", "turn_ended")], True, False)


def test_without_all_the_next_turn_is_not_sent_and_late_entries_of_others_are_skipped(store: Store) -> None:
    t1 = _turn(store, 1, "one")
    _say(store, t1, "a")
    pos, _ = _start(store, turn_id=t1)
    _round(store, pos)
    _end(store, t1)
    t2 = _turn(store, 2, "two")
    _say(store, t2, "b")
    shown, done, _ = _round(store, pos)
    assert shown == [("turn_ended", "end_turn"), ("end", "turn_ended")] and done
    # following t2 from its start: a late entry of t1 written meanwhile is not t2's
    pos2, _ = _start(store, turn_id=t2)
    _say(store, t1, "late")
    _say(store, None, json.dumps({"request_id": "r", "option_id": "allow"}), kind="permission_response")
    shown, done, _ = _round(store, pos2)
    assert [t for _, t in shown][:2] == ["two", "b"] and "late" not in [t for _, t in shown]
    assert ("entry", json.dumps({"request_id": "r", "option_id": "allow"})) in shown and not done


def test_all_follows_every_turn_with_an_end_line_for_each(store: Store) -> None:
    t1 = _turn(store, 1, "one")
    pos, _ = _start(store, follow_all=True)
    _say(store, t1, "a")
    _end(store, t1)
    t2 = _turn(store, 2, "two")
    _say(store, t2, "b")
    _end(store, t2, "cancelled")
    shown, done, more = _round(store, pos)
    assert shown == [("entry", "one"), ("entry", "a"), ("turn_ended", "end_turn"), ("entry", "two"), ("entry", "b")]
    assert more and not done  # a turn began in this round: its state is read at once
    shown, done, _ = _round(store, pos)
    assert shown == [("turn_ended", "cancelled")] and not done
    assert _round(store, pos) == ([], False, False)


def test_no_turn_and_no_agent_ends_at_once_but_a_live_session_waits(store: Store) -> None:
    pos, result = _start(store)
    assert result["turn_id"] is None
    assert _round(store, pos, live=True) == ([], False, False)
    t1 = _turn(store, 1, "first")
    shown, _, more = _round(store, pos, live=True)
    assert shown == [("entry", "first")] and more and pos.turn_id == t1
    with store.session() as db:
        db.query(Turn).delete()
        db.query(TranscriptEntry).delete()
    pos, _ = _start(store)
    assert _round(store, pos, live=False) == ([("end", "no_agent")], True, False)


def test_unknown_session_or_turn_is_not_found(store: Store) -> None:
    with pytest.raises(IpcError) as info, store.session() as db:
        start_position(db, "nope", after_seq=None, turn_id=None, follow_all=False)
    assert info.value.code == ErrorCode.NOT_FOUND
    with pytest.raises(IpcError) as info, store.session() as db:
        start_position(db, SID, after_seq=None, turn_id="other:1", follow_all=False)
    assert info.value.code == ErrorCode.NOT_FOUND


def test_permission_requests_say_whether_they_are_still_open(store: Store) -> None:
    t1 = _turn(store, 1, "/permission")
    with store.session() as db:
        for rid in ("r1", "r2"):
            transcript.append(db, SID, turn_id=t1, role="system", kind="permission_request",
                              text=json.dumps({"request_id": rid, "options": [{"optionId": "allow"}]}))
    _say(store, None, json.dumps({"request_id": "r1", "option_id": "allow"}), kind="permission_response")
    pos, _ = _start(store)
    with store.session() as db:
        r = read_round(db, pos, live=True)
    opened = {json.loads(e.data["text"])["request_id"]: e.data["open"] for e in r.events
              if e.data.get("kind") == "permission_request"}
    assert opened == {"r1": False, "r2": True}


def test_the_hub_wakes_followers_on_commits_from_any_thread_not_on_rollbacks(store: Store) -> None:
    hub = TranscriptHub()
    hub.observe(store)

    async def go() -> None:
        async with hub.watching(SID) as watch:
            seen = watch.version
            assert not await watch.wait(seen, 0.05)  # nothing committed
            with pytest.raises(RuntimeError), store.session() as db:
                transcript.append(db, SID, role="agent", kind="agent_message_chunk", text="x")
                db.flush()
                raise RuntimeError("rolled back")
            assert not await watch.wait(seen, 0.05)
            worker = threading.Thread(target=_say, args=(store, None, "from a thread"))
            worker.start()
            assert await watch.wait(seen, 5.0)  # woken by the commit in the worker thread
            worker.join()
            seen = watch.version
            with store.session() as db:
                db.add(Task(id="b" * 32, title="another"))  # not a session's transcript
            assert not await watch.wait(seen, 0.05)
            _end(store, _turn(store, 1, "p"))  # on the loop's thread too
            assert watch.version > seen
        assert hub._watches == {}  # nobody follows: nothing kept

    asyncio.run(go())


def test_a_client_that_does_not_read_holds_the_stream_back(store: Store, tmp_path: Path) -> None:
    """Backpressure: the stream's frames wait for the client (send_event awaits the socket's
    drain), so a client that stops reading leaves the backend holding a bounded buffer, not the
    transcript; once it reads again it gets every entry, in order (a real server on a real socket)."""
    from daemon.api import ops as api
    from daemon.backend.state.executions import ExecutionStore
    from daemon.backend.views.follow import FollowService
    from ipc.client import AsyncClient
    from ipc.schema import OpTable
    from ipc.server import IpcServer

    t1 = _turn(store, 1, "/flood")
    big = "x" * (16 * 1024)
    _say(store, t1, *[f"{i:04d}{big}" for i in range(500)])  # 8 MiB of text
    _end(store, t1)
    hub = TranscriptHub()
    hub.observe(store)
    service = FollowService(store, hub, ExecutionStore())
    table = OpTable("follow-test", (1, 0), [api.TABLE.get("follow")])
    sock = tmp_path / "f.sock"

    async def go() -> list[str]:
        async with IpcServer(sock, table, service.handlers()) as server:
            client = await AsyncClient.connect(sock)
            stream = await client.stream("follow", {"session_id": SID})
            await asyncio.sleep(1.0)  # the client reads nothing meanwhile
            (ctx,) = server.connections
            held = ctx._transport.get_write_buffer_size()
            assert held < 1024 * 1024, held  # bounded: not the 4 MiB a round holds, nor the 8 MiB stored
            texts = []
            async for ev in stream:
                if ev.kind == "entry":
                    texts.append(ev.data["text"][:4])
            return texts

    texts = asyncio.run(go())
    assert texts == ["/flo"] + [f"{i:04d}" for i in range(500)]
