"""A context reset checks its session again after its capture, with nothing awaited until STARTING.

The capture of the session's runtime config may ask the control server (``list_instances``, when
the catalogue of this backend lifetime is not cached yet), and a stop, a prompt or a task deletion
may land meanwhile; none of them takes the session's lock. The reset used to go on with what it
checked before the capture: a stopped session got a new agent (``--restart``) or went FAILED, a
session whose turn had begun raised an untyped error, and a task being deleted got a new agent.
Each case now ends in a ``conflict`` that changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.backend.sessions.context_reset import ContextReset
from daemon.backend.sessions.live import LiveSessions
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.executions import Execution
from daemon.store import transitions
from daemon.store.db import Store
from daemon.store.models import TaskSession
from daemon.store.states import SessionState
from ipc.errors import ErrorCode, IpcError
from tests.support.store_rows import new_session


class SlowServer:
    """A control server whose ``list_instances`` lets ``meanwhile`` happen before it answers."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile
        self.asked: list[str] = []

    async def list_instances(self) -> list[dict[str, Any]]:
        self.asked.append("list_instances")
        await asyncio.sleep(0)
        self.meanwhile()
        return []

    async def reset_context(self, instance_id: str) -> dict[str, Any]:
        self.asked.append("reset_context")
        raise IpcError(ErrorCode.NOT_FOUND, f"no instance {instance_id!r}")


def _reset(store: Store, happens: Callable[[Any, str, str], None]) -> tuple[IpcError, SlowServer, Any]:
    sid = new_session(store, SessionState.WAITING_FOR_INPUT)
    with store.session() as db:
        task_id = db.get_one(TaskSession, sid).task_id
    ex = Execution(sid, task_id, "instance-1", AgentIdentity(4242), None)
    backend: Any = SimpleNamespace(store=store, deleting_tasks=set())
    server = SlowServer(lambda: happens(backend, sid, task_id))
    backend.executions = SimpleNamespace(executions={sid: ex}, check_launch=lambda _sid: None)
    backend.servers = SimpleNamespace(client_for=lambda _ex: server)
    reset = ContextReset(backend, launcher=None, live=LiveSessions(backend))  # type: ignore[arg-type]
    with pytest.raises(IpcError) as raised:
        asyncio.run(reset.reset_context(sid))
    with store.session() as db:
        state = db.get_one(TaskSession, sid).state
    return raised.value, server, state


def test_a_stop_during_the_capture_refuses_the_reset(store: Store) -> None:
    def stopped(backend: Any, sid: str, task_id: str) -> None:
        del backend.executions.executions[sid]  # what session_stop does first

    error, server, state = _reset(store, stopped)
    assert error.code == ErrorCode.CONFLICT and "no running agent" in error.message
    assert server.asked == ["list_instances"] and state == SessionState.WAITING_FOR_INPUT


def test_a_turn_begun_during_the_capture_refuses_the_reset(store: Store) -> None:
    def prompted(backend: Any, sid: str, task_id: str) -> None:
        with store.session() as db:
            transitions.transition_session(db, sid, SessionState.RUNNING,
                                           expected_from={SessionState.WAITING_FOR_INPUT}, reason="prompt")

    error, server, state = _reset(store, prompted)
    assert error.code == ErrorCode.CONFLICT and "is RUNNING" in error.message
    assert server.asked == ["list_instances"] and state == SessionState.RUNNING


def test_a_deletion_begun_during_the_capture_refuses_the_reset(store: Store) -> None:
    def deleting(backend: Any, sid: str, task_id: str) -> None:
        backend.deleting_tasks.add(task_id)

    error, server, state = _reset(store, deleting)
    assert error.code == ErrorCode.CONFLICT and "being deleted" in error.message
    assert server.asked == ["list_instances"] and state == SessionState.WAITING_FOR_INPUT
