"""Requests between two cluster backends in one process, on a real PostgreSQL (Issue 47 item 2, Issue 47 item 6):
the router of host ``a`` hands an op to host ``b``'s runner through the store and gets back exactly
what ``b``'s handler answered or raised; ``b`` accepts only the routed ops, with the op table's
validation; an unreachable or silent host is ``host_unreachable``, and a request ``b`` never took up
in time is never run.

The handler tables here are stand-ins that record their calls (the real table is proved end to end in
tests/integration/test_cluster_requests.py); the store, the NOTIFYs and the listener are real.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from daemon.backend.cluster import requests, router
from daemon.backend.cluster.membership import Reachability
from daemon.backend.cluster.messaging import ClusterMessaging
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.store.db import Store
from daemon.store.models import ClusterRequest
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext
from tests.support.aio import run
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

SINCE = datetime(2026, 12, 7, 0, 10, tzinfo=UTC)


def _seen(name: str, state: str, since: datetime | None) -> Reachability:
    return Reachability(name, state, since, None, None, None, None)


class Hosts:
    """What the membership would say: every named host ready unless told otherwise."""

    def __init__(self) -> None:
        self.states = {"a": _seen("a", "ready", None), "b": _seen("b", "ready", None)}

    def __call__(self, name: str) -> Reachability | None:
        return self.states.get(name)


@pytest.fixture
def store(pg_store: Store) -> Store:
    """This module's tests run on PostgreSQL (LISTEN/NOTIFY, SKIP LOCKED)."""
    return pg_store


def _b_handlers(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    async def prompt(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        calls.append(("prompt", args))
        return {"turn_id": "t1", "text": args["text"], "wait": args.get("wait", False)}

    async def cancel(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        calls.append(("cancel", args))
        raise IpcError(ErrorCode.CONFLICT, f"session {args['session_id']} has no running turn", False,
                       {"session_id": args["session_id"]})

    async def task_delete(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        calls.append(("task_delete", args))
        return {}

    return {"prompt": prompt, "cancel": cancel, "task_delete": task_delete}


async def _pair(store: Store, hosts: Hosts, calls: list[tuple[str, dict[str, Any]]], *, serve_b: bool = True
                ) -> tuple[ClusterMessaging, ClusterMessaging]:
    a = ClusterMessaging(store, "a", hosts, TranscriptHub())
    b = ClusterMessaging(store, "b", hosts, TranscriptHub())
    for m, table in ((a, {}), (b, _b_handlers(calls))):
        m.use(m.wrap(table))
        m.start()
    await asyncio.to_thread(a.listener.connected.wait, 10)
    await asyncio.to_thread(b.listener.connected.wait, 10)
    if serve_b:
        await b.serve_requests()
    return a, b


def _rows(store: Store) -> list[ClusterRequest]:
    with store.session() as db:
        return list(db.scalars(select(ClusterRequest).order_by(ClusterRequest.id)))


def test_an_answer_and_a_typed_error_come_back_as_the_owner_gave_them(store):
    """Issue 47 item 2: ``b``'s handler's answer, and its typed error (code, message, retryability,
    details), reach ``a`` unchanged; each request ran once on ``b``."""
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> None:
        a, b = await _pair(store, Hosts(), calls)
        try:
            got = await a.router.forward("b", "prompt", {"session_id": "s1", "text": "hi", "wait": True})
            assert got == {"turn_id": "t1", "text": "hi", "wait": True}
            with pytest.raises(IpcError) as caught:
                await a.router.forward("b", "cancel", {"session_id": "s1"})
            assert caught.value.code == ErrorCode.CONFLICT and not caught.value.retryable
            assert caught.value.message == "session s1 has no running turn"
            assert caught.value.details == {"session_id": "s1"}
        finally:
            await a.stop()
            await b.stop()

    run(scenario())
    assert [c[0] for c in calls] == ["prompt", "cancel"]
    assert [(r.origin_host, r.host, r.state) for r in _rows(store)] == [("a", "b", "done")] * 2


def test_the_owner_validates_a_request_as_its_socket_would(store):
    """Issue 47 item 6: a request row (whoever wrote it) is validated by the op table (a missing or
    mistyped field: ``invalid_argument`` naming it) and only the routed ops run; the handler never
    sees a refused one."""
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> list[IpcError]:
        a, b = await _pair(store, Hosts(), calls)
        errors = []
        try:
            for op, args in (("prompt", {"session_id": "s1"}), ("prompt", {"session_id": 7, "text": "x"}),
                             ("task_delete", {"task_id": "t"}), ("no_such_op", {})):
                with pytest.raises(IpcError) as caught:
                    await a.router.forward("b", op, args)
                errors.append(caught.value)
        finally:
            await a.stop()
            await b.stop()
        return errors

    missing, mistyped, not_routed, unknown = run(scenario())
    assert missing.code == ErrorCode.INVALID_ARGUMENT and "text" in missing.message
    assert mistyped.code == ErrorCode.INVALID_ARGUMENT and "session_id" in mistyped.message
    assert not_routed.code == unknown.code == ErrorCode.PERMISSION_DENIED
    assert calls == []


def test_an_unreachable_host_is_refused_at_once_and_nothing_is_written(store):
    """Issue 47 item 2: a host the membership shows unreachable (or stopped) is ``host_unreachable``
    naming it and since when, before any request row; an unknown host is ``not_found``."""
    hosts = Hosts()
    hosts.states["b"] = _seen("b", "unreachable", SINCE)
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> tuple[IpcError, IpcError]:
        a, b = await _pair(store, hosts, calls)
        try:
            with pytest.raises(IpcError) as away:
                await a.router.forward("b", "prompt", {"session_id": "s1", "text": "x"})
            with pytest.raises(IpcError) as unknown:
                await a.router.forward("zz", "prompt", {"session_id": "s1", "text": "x"})
        finally:
            await a.stop()
            await b.stop()
        return away.value, unknown.value

    away, unknown = run(scenario())
    assert away.code == requests.HOST_UNREACHABLE and away.retryable
    assert "host b is unreachable since 2026-12-07T00:10:00+00:00" in away.message
    assert away.details is not None and away.details["host"] == "b"
    assert unknown.code == ErrorCode.NOT_FOUND and "zz" in unknown.message
    assert _rows(store) == [] and calls == []


def test_a_request_not_taken_up_in_time_is_refused_and_never_runs(store, monkeypatch):
    """Issue 47 item 2: ``b`` looks alive but does not claim within the bound: ``host_unreachable``
    for ``a``, the request is answered so, and ``b`` starting later does not run it."""
    monkeypatch.setattr(router, "CLAIM_BOUND_S", 0.5)
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> tuple[IpcError, Any]:
        a, b = await _pair(store, Hosts(), calls, serve_b=False)
        try:
            with pytest.raises(IpcError) as caught:
                await a.router.forward("b", "prompt", {"session_id": "s1", "text": "late"})
            await b.serve_requests()
            return caught.value, await asyncio.to_thread(b.runner._claim)  # nothing left to claim
        finally:
            await a.stop()
            await b.stop()

    error, left = run(scenario())
    assert error.code == requests.HOST_UNREACHABLE and "will not run" in error.message
    assert left is None and calls == []
    (row,) = _rows(store)
    assert row.state == "done" and row.error is not None and row.error["code"] == requests.HOST_UNREACHABLE


def test_requests_written_while_the_owner_was_down_run_when_it_starts(store):
    """Issue 47 item 2: requests pending for ``b`` while its backend is down are claimed by its
    start (no notification needed), each once, and the waiting requester gets the answer."""
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> list[Any]:
        a, b = await _pair(store, Hosts(), calls, serve_b=False)
        try:
            waiting = [asyncio.create_task(a.router.forward("b", "prompt", {"session_id": "s", "text": str(i)}))
                       for i in range(3)]
            await asyncio.to_thread(wait_until, lambda: len(_rows(store)) == 3, 30)
            await b.serve_requests()
            return list(await asyncio.gather(*waiting))
        finally:
            await a.stop()
            await b.stop()

    answers = run(scenario())
    assert [x["text"] for x in answers] == ["0", "1", "2"]
    assert sorted(c[1]["text"] for c in calls) == ["0", "1", "2"]


def test_two_runners_woken_together_carry_out_each_request_once(store):
    """Issue 47 item 2: two runners of host ``b`` (as two backends racing, each woken by every
    notification) and 20 requests at once: each request runs exactly once, each answer reaches its
    requester."""
    calls: list[tuple[str, dict[str, Any]]] = []

    async def scenario() -> list[Any]:
        a, b1 = await _pair(store, Hosts(), calls)
        b2 = ClusterMessaging(store, "b", Hosts(), TranscriptHub())
        b2.use(b2.wrap(_b_handlers(calls)))
        b2.start()
        await asyncio.to_thread(b2.listener.connected.wait, 10)
        await b2.serve_requests()
        try:
            return list(await asyncio.gather(*(a.router.forward("b", "prompt", {"session_id": "s", "text": str(i)})
                                               for i in range(20))))
        finally:
            for m in (a, b1, b2):
                await m.stop()

    answers = run(scenario())
    assert [x["text"] for x in answers] == [str(i) for i in range(20)]
    assert sorted(int(c[1]["text"]) for c in calls) == list(range(20))
