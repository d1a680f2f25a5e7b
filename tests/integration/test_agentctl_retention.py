"""Detached event retention, end to end: a real control server (``python -m daemon.agentctl.main
--launch-file ...``) and the real mock agent, driven through the real client.

AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6, AC-EXECUTORS-SURVIVAL-001.9, AC-EXECUTORS-SURVIVAL-001.10, AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.3, AC-EXECUTORS-SURVIVAL-004.6 (docs/architecture.md#the-control-server-inside):
while an instance's stream is not attached, at most ``detached_event_limit`` undelivered events
are retained; then the agent's output is no longer read, so the agent blocks on its own stdout
pipe and nothing is dropped. An attach resumes production; a stop releases everything at once.

The server is ``tests/support/agentctl.py``'s; every wait is bounded and the teardown
SIGTERMs/SIGKILLs the server and every agent process group a test saw.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.protocol import EventKind
from ipc.client import Event
from tests.support.agentctl import STEP, Server, start_server, stop_server, write_launch
from tests.support.aio import run
from tests.support.processes import group_exists
from tests.support.streams import (
    chunks,
    collect_until,
    instance_entry,
    turn_ended,
    wait_instance,
    wait_outcome,
)
from tests.support.waiting import eventually, wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def make_server(short_tmp: Path) -> Iterator[Callable[..., Server]]:
    """Start a control server with launch-file overrides (e.g. ``detached_event_limit``)."""
    started: list[Server] = []

    def make(**overrides: Any) -> Server:
        root = short_tmp / f"s{len(started)}"
        root.mkdir(mode=0o700)
        srv = write_launch(root, **overrides)
        started.append(srv)
        start_server(srv)
        return srv

    try:
        yield make
    finally:
        for srv in started:
            stop_server(srv)


async def retained_at_least(client: AgentctlClient, iid: str, n: int) -> bool:
    return int((await instance_entry(client, iid))["retained_events"]) >= n


async def until_paused(client: AgentctlClient, iid: str, timeout: float = STEP) -> dict[str, Any]:
    return await wait_instance(client, iid, lambda entry: entry["paused"], timeout, what="paused")


def history_lines(server: Server, acp_session_id: str) -> int:
    """How many chunks the mock has recorded: it records one only after writing it to the pipe."""
    path = server.mock_state / f"{acp_session_id}.history.jsonl"
    return len(path.read_bytes().splitlines()) if path.exists() else 0


async def settle_progress(server: Server, acp_session_id: str, quiet: float = 0.5) -> int:
    """Wait (bounded) until the mock records no chunk for ``quiet`` s; its history count."""
    deadline = time.monotonic() + STEP
    last = history_lines(server, acp_session_id)
    while True:
        await asyncio.sleep(quiet)
        now = history_lines(server, acp_session_id)
        if now == last:
            return now
        assert time.monotonic() < deadline, f"the agent never blocked: {now} history lines"
        last = now


def agent_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


# ---------------------------------------------------------------- Issue 4 scenario B


def test_flood_5000_detached_pauses_the_agent_then_attach_hands_over_everything(make_server):
    """Issue 4 scenario B; AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6: /flood 5000 with no stream and limit 100:
    the agent is alive and blocked (retained stays at 100, paused, the mock has not finished and
    makes no progress), nothing is dropped; an attach delivers all 5000 chunks exactly once, in
    order, and the turn ends."""
    server = make_server(detached_event_limit=100)
    n = 5000

    async def scenario() -> tuple[list[Event], list[dict[str, Any]], list[int], int, dict[str, Any]]:
        async with await server.connect() as client:
            created = await server.create(client)
            iid, sid, pid = created["instance_id"], created["acp_session_id"], created["pid"]
            turn = await client.prompt(iid, f"/flood {n}")
            entries = [await until_paused(client, iid)]
            # The agent writes on until the pipe and the server's small read buffer are full.
            await settle_progress(server, sid)
            progress = [history_lines(server, sid)]
            for _ in range(3):  # the pause holds: no progress, nothing retained beyond the bound
                await asyncio.sleep(0.7)
                entries.append(await instance_entry(client, iid))
                progress.append(history_lines(server, sid))
            assert agent_alive(pid)
            assert (await client.turn_status(iid)) == {"current_turn_id": turn, "outcomes": []}
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn), timeout=STEP * 3)
                after = await instance_entry(client, iid)
            finally:
                await stream.close()
            return events, entries, progress, pid, after

    events, entries, progress, pid, after = run(scenario())
    for entry in entries:
        assert entry["paused"] is True and entry["attached"] is False, entry
        assert entry["retained_events"] == 100 and entry["detached_event_limit"] == 100, entry
        assert entry["state"] == "running"
    assert len(set(progress)) == 1, f"the agent kept writing while paused: {progress}"
    assert 1 <= progress[0] < n + 1, f"the mock finished: {progress[0]} history lines"
    assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
    assert [e.seq for e in events] == list(range(1, n + 3))
    assert kinds(events)[0] == EventKind.TURN_STARTED and events[-1].data["stop_reason"] == "end_turn"
    assert after["paused"] is False and after["attached"] is True
    assert agent_alive(pid)


# ---------------------------------------------------------------- per instance (AC-EXECUTORS-SURVIVAL-001.9)


def test_pause_is_per_instance_by_its_own_stream(make_server):
    """AC-EXECUTORS-SURVIVAL-001.9: two instances of one owned server, one attached, one not: only
    the detached one pauses; the attached one runs its whole flood through."""
    server = make_server(detached_event_limit=100)
    n = 3000

    async def scenario() -> tuple[list[Event], dict[str, Any], dict[str, Any], int]:
        async with await server.connect() as client:
            a = await server.create(client, session_id="attached")
            b = await server.create(client, session_id="detached")
            stream = await client.attach(a["instance_id"], 0)
            try:
                turn_a = await client.prompt(a["instance_id"], f"/flood {n}")
                turn_b = await client.prompt(b["instance_id"], f"/flood {n}")
                events = await collect_until(stream, turn_ended(turn_a), timeout=STEP * 3)
                entry_a = await instance_entry(client, a["instance_id"])
                entry_b = await until_paused(client, b["instance_id"])
                await settle_progress(server, b["acp_session_id"])
                entry_b = await instance_entry(client, b["instance_id"])
                status_b = await client.turn_status(b["instance_id"])
                assert status_b["current_turn_id"] == turn_b and status_b["outcomes"] == []
            finally:
                await stream.close()
            return events, entry_a, entry_b, history_lines(server, b["acp_session_id"])

    events, entry_a, entry_b, progress_b = run(scenario())
    assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
    assert entry_a["attached"] is True and entry_a["paused"] is False
    assert entry_a["retained_events"] > 100  # attached: retained until acked, never paused
    assert entry_b["attached"] is False and entry_b["paused"] is True and entry_b["retained_events"] == 100
    assert progress_b < n + 1


# ---------------------------------------------------------------- stop (AC-EXECUTORS-SURVIVAL-001.10)


def test_stop_of_a_paused_instance_is_prompt_and_kills_the_group(make_server):
    """AC-EXECUTORS-SURVIVAL-001.10: stopping a paused instance does not wait for a backend; it
    completes promptly, kills the whole group and discards what was retained."""
    server = make_server(detached_event_limit=100)

    async def scenario() -> tuple[float, int, list[dict[str, Any]]]:
        async with await server.connect() as client:
            created = await server.create(client)
            iid = created["instance_id"]
            await client.prompt(iid, "/flood 5000")
            await until_paused(client, iid)
            started = time.monotonic()
            assert await client.stop_instance(iid) == {"stopped": True, "already_absent": False}
            return time.monotonic() - started, created["pid"], await client.list_instances()

    elapsed, pgid, listed = run(scenario())
    assert elapsed < 5.0, f"stop took {elapsed:.1f} s"
    assert listed == []
    wait_until(lambda: not group_exists(pgid), 10, message="agent group gone")
    assert server.proc is not None and server.proc.poll() is None


def test_sigterm_with_paused_instances_exits_promptly(make_server):
    """AC-EXECUTORS-SURVIVAL-001.10 for the server-wide stop: every paused producer is released, every group killed."""
    server = make_server(detached_event_limit=10)

    async def scenario() -> list[int]:
        async with await server.connect() as client:
            pids = []
            for i in range(2):
                created = await server.create(client, session_id=f"s{i}")
                await client.prompt(created["instance_id"], "/flood 3000")
                await until_paused(client, created["instance_id"])
                pids.append(created["pid"])
            return pids

    pids = run(scenario())
    assert server.proc is not None
    started = time.monotonic()
    server.proc.terminate()
    assert server.proc.wait(20) == 0
    assert time.monotonic() - started < 10
    for pid in pids:
        wait_until(lambda pid=pid: not group_exists(pid), 10, message=f"group {pid} gone")


# ---------------------------------------------------------------- the bounds of the limit


@pytest.mark.parametrize(("limit", "n"), [(1, 300), (10000, 10500)])
def test_limit_extremes(make_server, limit: int, n: int):
    """AC-EXECUTORS-SURVIVAL-001.6, AC-EXECUTORS-SURVIVAL-001.8: the smallest and largest accepted limits pause exactly at
    the bound and hand everything over after an attach."""
    server = make_server(detached_event_limit=limit)

    async def scenario() -> tuple[list[Event], dict[str, Any]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, f"/flood {n}")
            entry = await until_paused(client, iid, timeout=STEP * 3)
            await asyncio.sleep(0.3)  # a window: paused at the bound, it stays exactly there
            entry = await instance_entry(client, iid)
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn), timeout=STEP * 3)
            finally:
                await stream.close()
            return events, entry

    events, entry = run(scenario(), timeout=200)
    assert entry["paused"] is True and entry["retained_events"] == limit
    assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
    assert [e.seq for e in events] == list(range(1, n + 3))


# ---------------------------------------------------------------- permissions (AC-EXECUTORS-SURVIVAL-001.9, Issue 4 scenario C)


def test_permission_raised_while_detached_stays_open_then_is_answered_after_attach(make_server):
    """AC-EXECUTORS-SURVIVAL-001.9, Issue 4 scenario C (server half): a permission request the agent raises
    while no stream is attached is not auto-cancelled (Kandev's timer was 5 s): after 6 s it is
    still open, and a backend that attaches later answers it."""
    server = make_server(detached_event_limit=100)

    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/permission")
            await eventually(lambda: retained_at_least(client, iid, 2), STEP, message="2 events retained")
            await asyncio.sleep(6.0)  # a window longer than the old 5 s auto-cancel timer
            entry = await instance_entry(client, iid)
            assert entry["retained_events"] == 2 and entry["paused"] is False
            assert (await client.turn_status(iid))["current_turn_id"] == turn
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, lambda e: e.kind == EventKind.PERMISSION_REQUEST)
                await client.respond_permission(iid, events[-1].data["request_id"], "allow")
                events += await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            return events

    events = run(scenario())
    assert kinds(events) == ["turn_started", "permission_request", "session_update", "turn_ended"]
    assert chunks(events) == ["permission: allow"]
    assert events[-1].data["stop_reason"] == "end_turn"


def test_permission_request_held_back_by_the_bound_is_delivered_after_attach(make_server):
    """Limit 1: turn_started fills the bound, so the request is not even read until an attach;
    the agent waits, nothing expires, and the request is answered after the attach."""
    server = make_server(detached_event_limit=1)

    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/permission")
            entry = await until_paused(client, iid)
            assert entry["retained_events"] == 1
            await asyncio.sleep(1.0)  # a window: held back, the request neither expires nor is read
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, lambda e: e.kind == EventKind.PERMISSION_REQUEST)
                await client.respond_permission(iid, events[-1].data["request_id"], "reject")
                events += await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            return events

    events = run(scenario())
    assert kinds(events) == ["turn_started", "permission_request", "session_update", "turn_ended"]
    assert chunks(events) == ["permission: reject"]


def test_permission_cancelled_at_the_bound_is_retained(make_server):
    """AC-EXECUTORS-SURVIVAL-001.6 for the permission-cancelled class: a cancel while the log is at the bound answers the
    open request 'cancelled'; its event is appended past the bound (server-originated), the
    agent's next chunk is then held back, and everything is handed over after the attach, in
    order."""
    server = make_server(detached_event_limit=2)

    async def scenario() -> tuple[list[Event], dict[str, Any]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/permission")
            # full, the agent waits for us
            await eventually(lambda: retained_at_least(client, iid, 2), STEP, message="2 events retained")
            await client.cancel(iid)
            entry = await until_paused(client, iid)  # the agent's answer chunk is held back
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            return events, entry

    events, entry = run(scenario())
    assert entry["retained_events"] == 3
    assert kinds(events) == [
        "turn_started", "permission_request", "permission_cancelled", "session_update", "turn_ended",
    ]
    request, cancelled = events[1].data, events[2].data
    assert cancelled == {"request_id": request["request_id"], "turn_id": request["turn_id"], "reason": "cancel"}
    assert chunks(events) == ["permission: cancelled"]
    assert events[-1].data["stop_reason"] == "cancelled"


# ---------------------------------------------------------------- agent exit under the bound


def test_agent_exit_while_paused_is_reported_after_its_held_back_output(make_server):
    """AC-EXECUTORS-SURVIVAL-001.6 for the process-exit class: the agent writes a chunk and exits while the producer is
    parked; agent_exited never overtakes the held-back chunk and nothing is lost."""
    server = make_server(detached_event_limit=1)

    async def scenario() -> tuple[list[Event], dict[str, Any], dict[str, Any]]:
        async with await server.connect() as client:
            created = await server.create(client)
            iid = created["instance_id"]
            turn = await client.prompt(iid, "/exit 7")
            await until_paused(client, iid)
            wait_until(lambda: not agent_alive(created["pid"]), 10, message="the agent exited")
            await asyncio.sleep(3.0)  # longer than the stdout drain grace
            entry = await instance_entry(client, iid)
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            outcome = await wait_outcome(client, iid, turn)
            return events, entry, outcome

    events, entry, outcome = run(scenario())
    assert entry["paused"] is True and entry["retained_events"] == 1
    assert kinds(events) == ["turn_started", "session_update", "agent_exited", "turn_ended"]
    assert chunks(events) == ["exiting 7"]
    assert events[2].data["exit_code"] == 7
    assert outcome["stop_reason"] == "agent_exited"


# ---------------------------------------------------------------- turn outcomes (AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.3, AC-EXECUTORS-SURVIVAL-004.6)


def test_outcome_retained_while_detached_is_repeatable_until_acked(make_server):
    """AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.6: a turn that ends while detached keeps its outcome under
    the server's turn id; reading is repeatable, delivering its event does not discard it, only
    an ack naming it does."""
    server = make_server(detached_event_limit=100)

    async def scenario() -> None:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "hello")
            outcome = await wait_outcome(client, iid, turn)
            first = await client.turn_status(iid)
            assert first == {"current_turn_id": None, "outcomes": [outcome]}
            await asyncio.sleep(0.5)  # a window: reading the outcome again later discards nothing
            assert await client.turn_status(iid) == first
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            assert events[-1].data == outcome
            assert await client.turn_status(iid) == first  # delivered, still retained
            assert (await client.ack_turn(turn))["acked"] is True
            assert await client.turn_status(iid) == {"current_turn_id": None, "outcomes": []}
            assert (await client.ack_turn(turn))["acked"] is False

    run(scenario())


def test_terminal_event_produced_after_attach_is_delivered(make_server):
    """AC-EXECUTORS-SURVIVAL-004.3: a turn held open by the pause (no outcome while detached) ends
    once a stream attaches; its terminal event is delivered on that stream and its outcome is
    retained until acked."""
    server = make_server(detached_event_limit=100)
    n = 400

    async def scenario() -> None:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, f"/flood {n}")
            await until_paused(client, iid)
            assert await client.turn_status(iid) == {"current_turn_id": turn, "outcomes": []}
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
            assert events[-1].data == {"turn_id": turn, "stop_reason": "end_turn", "error": None}
            status = await client.turn_status(iid)
            assert status == {"current_turn_id": None, "outcomes": [events[-1].data]}
            assert (await client.ack_turn(turn))["acked"] is True

    run(scenario())


@pytest.mark.parametrize("batched", [True, False])
def test_a_stream_in_event_batches_and_one_frame_per_event_deliver_the_same_events(make_server, batched: bool):
    """This release's backend asks for the events of one write in one frame (``batched``); a 0.2.0
    backend does not and gets a frame per event. The same flood reaches either whole and in order."""
    server = make_server()
    n = 2000

    async def scenario() -> tuple[list[Event], bool]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, f"/flood {n}")
            stream = await client.attach(iid, 0, batched=batched)
            events: list[Event] = []
            several_in_a_frame = False
            try:
                while not events or events[-1].kind != EventKind.TURN_ENDED:
                    events.append(await asyncio.wait_for(stream.__anext__(), STEP * 3))
                    several_in_a_frame |= bool(stream._ready)  # the rest of its frame, not returned yet
            finally:
                await stream.close()
            assert events[-1].data["turn_id"] == turn
            return events, several_in_a_frame

    events, several_in_a_frame = run(scenario())
    assert [e.seq for e in events] == list(range(1, n + 3))
    assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
    assert several_in_a_frame is batched


def test_reattach_after_a_dropped_stream_resumes_from_the_last_applied(make_server):
    """AC-EXECUTORS-SURVIVAL-001.5 with the bound: a stream that dies mid-flood leaves the instance detached again, so it
    pauses at the bound counting what was sent but not acked; a re-attach after the last applied
    seq loses and repeats nothing."""
    server = make_server(detached_event_limit=50)
    n = 20000  # still flooding when the stream drops at 700, on a loaded host too: an agent done
    # writing before the drop never parks (a full log whose agent is silent is not paused)

    async def scenario() -> tuple[list[Event], list[Event], dict[str, Any]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            first = await client.attach(iid, 0)
            turn = await client.prompt(iid, f"/flood {n}")
            part1 = await collect_until(first, lambda e: chunks([e]) == [f"700/{n} "])
            await client.ack_events(iid, part1[-1].seq)
            await first.close()
            entry = await until_paused(client, iid)
            second = await client.attach(iid, part1[-1].seq)
            try:
                part2 = await collect_until(second, turn_ended(turn), timeout=STEP * 3)
            finally:
                await second.close()
            return part1, part2, entry

    part1, part2, entry = run(scenario())
    assert entry["paused"] is True and entry["retained_events"] >= 50
    assert part2[0].seq == part1[-1].seq + 1
    assert chunks(part1 + part2) == [f"{i}/{n} " for i in range(1, n + 1)]
