"""The task list, the board and ``follow`` see a session's state and its agent of one moment.

A launch commits its session's new state (WAITING_FOR_INPUT) and starts tracking the agent in one
step of the event loop. A view that read what this backend tracks on the loop and the rows in a
worker thread could have that step fall in between: it then showed a session waiting for input
without an agent (the task list and the board placed its task in "needs attention: no agent";
``follow`` ended its stream with ``no_agent``). Each now reads again when tracking changed during
its read. These tests make the launch's step land inside the read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.executions import Execution, ExecutionStore
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.follow import FollowService, Position, Round
from daemon.backend.views.lists import Views
from daemon.store.db import Store
from daemon.store.models import TaskSession
from daemon.store.states import SessionState
from ipc.server import ConnectionContext
from tests.support.store_rows import new_session
from tests.support.waiting import eventually


class Launch:
    """The launch of a session's agent, its one loop step done when ``land`` is called."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.session_id = new_session(store, SessionState.STARTING)
        self.executions = ExecutionStore()

    def land(self) -> None:
        with self.store.session() as db:
            session = db.get_one(TaskSession, self.session_id)
            session.state = SessionState.WAITING_FOR_INPUT
            task_id = session.task_id
        self.executions.executions[self.session_id] = Execution(
            self.session_id, task_id, "instance-1", AgentIdentity(4242), None)


def test_a_launch_during_the_task_list_read_shows_its_session_with_its_agent(store: Store) -> None:
    launch = Launch(store)
    views = Views(store, launch.executions)
    read_tasks = views.read_tasks

    reads: list[dict[str, bool]] = []

    def read_during_the_launch(tracked: dict[str, bool]) -> dict[str, Any]:
        reads.append(tracked)
        if len(reads) == 1:
            launch.land()  # after this backend's tracking was read, before the rows are
        return read_tasks(tracked)

    views.read_tasks = read_during_the_launch  # type: ignore[method-assign]
    ctx = ConnectionContext.__new__(ConnectionContext)
    (task,) = asyncio.run(views.op_task_list(ctx, {}))["tasks"]
    assert task["latest_session"]["state"] == SessionState.WAITING_FOR_INPUT
    assert task["latest_session"]["live"] is True and task["attention"] is None, task
    assert reads == [{}, {launch.session_id: False}]  # read again, with the agent
    launch.executions.executions.clear()
    board = asyncio.run(views.op_board(ctx, {}))  # no agent now, and truly so: needs attention
    assert board["needs_attention"] == [task["task_id"]], board


class Client:
    """What ``follow`` sends, as a client would read it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    async def start_stream(self, result: Any) -> None:
        pass

    async def send_event(self, seq: int, kind: str, data: dict[str, Any]) -> None:
        self.events.append((kind, data))


def test_a_launch_during_a_follow_read_does_not_end_the_stream_for_want_of_an_agent(store: Store) -> None:
    launch = Launch(store)
    follow = FollowService(store, TranscriptHub(), launch.executions)
    read_round = follow._round
    rounds: list[bool] = []  # each round's liveness

    def read_during_the_launch(pos: Position, live: bool, replaying: frozenset[str]) -> Round:
        rounds.append(live)
        if len(rounds) == 1:
            launch.land()  # after the stream saw no agent, before the session's state is read
        return read_round(pos, live, replaying)

    follow._round = read_during_the_launch  # type: ignore[method-assign]
    client = Client()

    async def scenario() -> None:
        following = follow.op_follow(client, {"session_id": launch.session_id})  # type: ignore[arg-type]
        stream = asyncio.create_task(following)
        await eventually(lambda: len(rounds) >= 2 or stream.done(), timeout=10)
        assert not stream.done() and client.events == [], client.events  # still following
        assert rounds == [False, True]  # read again, with the agent
        stream.cancel()

    asyncio.run(scenario())
