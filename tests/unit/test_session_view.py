"""daemon.backend.views.session_view: transcript pages are bounded in entries and bytes (Issue 10 item 8);
a permission request whose turn ended is no longer open (Issue 45 scenario A)."""

from __future__ import annotations

import json

import pytest

from daemon.backend.views.session_view import (
    ENTRY_TEXT_MAX,
    PAGE_TEXT_BYTES,
    PageRequest,
    permissions,
    read_session,
)
from daemon.store import transcript
from daemon.store.db import Store
from daemon.store.models import Task, TaskSession, Turn
from ipc.codec_msgpack import encode_frame
from ipc.errors import ErrorCode, IpcError


def _session(store: Store, texts: list[str]) -> str:
    with store.session() as db:
        task = Task(title="t")
        db.add(task)
        db.flush()
        session = TaskSession(task_id=task.id, agent="mock")
        db.add(session)
        db.flush()
        for i, t in enumerate(texts):
            transcript.append(db, session.id, role="agent", kind="agent_message_chunk", text=t, event_seq=i + 1)
        return session.id


def _page(store: Store, sid: str, **args: int) -> tuple[list[dict], dict]:
    with store.session() as db:
        stored = read_session(db, sid, PageRequest.from_args(args))
    assert stored is not None
    return stored.transcript, stored.page


def test_pages_stop_at_the_text_budget_and_cut_huge_entries(store: Store) -> None:
    big = "x" * (ENTRY_TEXT_MAX + 1000)
    sid = _session(store, ["first"] + [big] * 30 + ["last"])
    entries, page = _page(store, sid)
    assert entries[-1]["text"] == "last"
    assert all(len(e["text"]) <= ENTRY_TEXT_MAX for e in entries)
    assert entries[0].get("text_truncated") is True
    assert sum(len(e["text"]) for e in entries) <= PAGE_TEXT_BYTES
    assert page["more_before"] is True and page["count"] == len(entries) < 32
    encode_frame({"transcript": entries, "page": page})  # fits in one frame


def test_after_seq_pages_forward_and_tail_takes_the_newest(store: Store) -> None:
    sid = _session(store, [f"{i}/50 " for i in range(1, 51)])
    first, page = _page(store, sid, after_seq=0, limit=20)
    assert [e["text"] for e in first] == [f"{i}/50 " for i in range(1, 21)]
    assert page["more_after"] and not page["more_before"] and page["total"] == 50
    second, page = _page(store, sid, after_seq=page["next_cursor"], limit=20)
    assert [e["text"] for e in second] == [f"{i}/50 " for i in range(21, 41)]
    tail, page = _page(store, sid, tail=3)
    assert [e["text"] for e in tail] == ["48/50 ", "49/50 ", "50/50 "]
    assert page["more_before"] and not page["more_after"]
    rest, page = _page(store, sid, after_seq=tail[-1]["cursor"])
    assert rest == [] and page["next_cursor"] == tail[-1]["cursor"]


@pytest.mark.parametrize("args", [{"tail": 0}, {"tail": 10_001}, {"limit": 0}, {"after_seq": -1},
                                  {"tail": 5, "after_seq": 0}])
def test_bad_page_arguments_are_refused(args: dict[str, int]) -> None:
    with pytest.raises(IpcError) as info:
        PageRequest.from_args(args)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_a_request_of_an_ended_turn_is_not_open(store: Store) -> None:
    """Issue 45 scenario A: a control server SIGKILLed with its agents sends no
    ``permission_cancelled``; the interrupted turn's request must not stay open for good (the
    session waits for input, and answering it would fail ``not_found``)."""
    sid = _session(store, [])
    with store.session() as db:
        for ordinal, (turn, state) in enumerate((("t:1", "abandoned"), ("t:2", "open")), start=1):
            db.add(Turn(id=turn, session_id=sid, ordinal=ordinal, prompt="/permission", state=state))
            transcript.append(db, sid, role="agent", kind="permission_request", event_seq=ordinal,
                              text=json.dumps({"request_id": f"r{ordinal}", "turn_id": turn,
                                               "options": [{"optionId": "allow"}]}))
        db.flush()
        assert {p["request_id"]: p["state"] for p in permissions(db, sid)} == {"r1": "cancelled", "r2": "open"}
