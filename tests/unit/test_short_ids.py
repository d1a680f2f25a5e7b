"""daemon.backend.views.ids: a unique prefix (>= 4 characters) stands for a task, session or permission
request id; an ambiguous one is refused with ``ambiguous_id`` listing the candidates (Issue 14 scenario B, at the store level: ids chosen so that they collide)."""

from __future__ import annotations

import asyncio
import json

import pytest

from daemon.api import ops as api
from daemon.backend.views.ids import CANDIDATES_SHOWN, IdKind, IdResolver, resolve, resolve_request, resolving
from daemon.store import transcript
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession
from ipc.errors import ErrorCode, IpcError

A = "abcd1111" + "0" * 24
B = "abcd2222" + "0" * 24
C = "9f9f" + "1" * 28


@pytest.fixture
def store(any_store: Store) -> Store:
    """SQLite and a real PostgreSQL server (prefix matching must mean the same on both)."""
    with any_store.session() as db:
        for tid in (A, B, C):
            db.add(Task(id=tid, title=f"task {tid[:8]}"))
        db.flush()
        db.add(TaskSession(id=A, task_id=A, agent="mock"))
        db.add(TaskSession(id=C, task_id=C, agent="mock"))
    return any_store


def _resolve(store: Store, kind: IdKind, given: str) -> str:
    with store.session() as db:
        return resolve(db, kind, given)


def test_a_unique_prefix_resolves_and_full_ids_pass_unchanged(store: Store) -> None:
    assert _resolve(store, IdKind.TASK, "abcd1111") == A
    assert _resolve(store, IdKind.TASK, "9f9f") == C
    assert _resolve(store, IdKind.TASK, "9F9F1") == C  # people may type upper case
    assert _resolve(store, IdKind.SESSION, "abcd") == A  # unique among sessions (B has none)
    assert _resolve(store, IdKind.TASK, A) == A
    assert _resolve(store, IdKind.TASK, "f" * 32) == "f" * 32  # a full id is never looked up


@pytest.mark.parametrize("given", ["abc", "ab", "", "abcd%", "ab_d", "zzzz", "0000"])
def test_short_or_foreign_or_unmatched_ids_are_passed_on_for_not_found(store: Store, given: str) -> None:
    """Fewer than 4 characters, non-hex text (LIKE wildcards included) or no match: unchanged, so the
    op answers not_found naming what was given."""
    assert _resolve(store, IdKind.TASK, given) == given


def test_an_ambiguous_prefix_is_refused_with_the_candidates(store: Store) -> None:
    with pytest.raises(IpcError) as info:
        _resolve(store, IdKind.TASK, "abcd")
    err = info.value
    assert err.code == ErrorCode.AMBIGUOUS_ID == "ambiguous_id" and not err.retryable
    assert A in err.message and B in err.message
    assert err.details == {"kind": "task", "given": "abcd", "candidates": [A, B], "total": 2}
    back = IpcError.from_wire(err.to_wire())  # the candidates cross the wire for --json callers
    assert back.details == err.details


def test_many_candidates_are_counted_not_all_listed(any_store: Store) -> None:
    with any_store.session() as db:
        for i in range(CANDIDATES_SHOWN + 5):
            db.add(Task(id=f"beef{i:028x}", title="t"))
    with pytest.raises(IpcError) as info, any_store.session() as db:
        resolve(db, IdKind.TASK, "beef")
    assert info.value.details["total"] == CANDIDATES_SHOWN + 5
    assert len(info.value.details["candidates"]) == CANDIDATES_SHOWN and "and 5 more" in info.value.message


def test_permission_requests_resolve_within_their_session(store: Store) -> None:
    r1, r2 = "77aa" + "1" * 28, "77aa" + "2" * 28
    with store.session() as db:
        for rid in (r1, r2):
            transcript.append(db, A, role="system", kind="permission_request",
                              text=json.dumps({"request_id": rid, "options": [{"optionId": "allow"}]}))
    with store.session() as db:
        assert resolve_request(db, A, "77aa1") == r1
        assert resolve_request(db, A, "77AA2222") == r2
        assert resolve_request(db, C, "77aa1") == "77aa1"  # another session's request: not found there
        with pytest.raises(IpcError) as info:
            resolve_request(db, A, "77aa")
    assert info.value.code == ErrorCode.AMBIGUOUS_ID and info.value.details["candidates"] == [r1, r2]


def test_the_wrapper_resolves_every_id_argument_of_every_op(store: Store) -> None:
    seen: dict[str, dict] = {}

    async def record(ctx, args):  # a handler that shows what it was given
        seen[args.pop("_op")] = args
        return args

    handlers = {name: record for name in ("session_show", "task_show", "permission_respond", "status")}
    wrapped = resolving(api.TABLE, store, handlers)
    assert wrapped["status"] is record  # no id argument: not wrapped

    async def go() -> None:
        await wrapped["session_show"](None, {"_op": "session_show", "session_id": "9f9f", "tail": 3})
        await wrapped["task_show"](None, {"_op": "task_show", "task_id": "abcd2222"})
        await wrapped["session_show"](None, {"_op": "full", "session_id": A})
        with pytest.raises(IpcError) as info:
            await wrapped["task_show"](None, {"_op": "x", "task_id": "abcd"})
        assert info.value.code == ErrorCode.AMBIGUOUS_ID

    asyncio.run(go())
    assert seen["session_show"] == {"session_id": C, "tail": 3}
    assert seen["task_show"] == {"task_id": B}
    assert seen["full"] == {"session_id": A}
    assert IdResolver(store).resolve_args((IdKind.SESSION, IdKind.PERMISSION_REQUEST),
                                          {"session_id": "abcd", "request_id": "0123"}) == \
        {"session_id": A, "request_id": "0123"}
