"""``SessionMetadata``: the named operations on ``task_sessions.metadata_json`` write exactly the
keys the backend has always written, and keep every key they do not name."""

from __future__ import annotations

from daemon.store.models import TaskSession
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import SessionState


def _session(meta: dict | None) -> TaskSession:
    return TaskSession(id="s1", task_id="t1", agent="mock", state=SessionState.WAITING_FOR_INPUT,
                       metadata_json=meta)


def test_a_new_session_has_an_empty_runtime_configuration_and_no_token() -> None:
    meta = SessionMetadata.new()
    assert meta.to_json() == {"runtime_config": {"model": None, "mode": None, "options": {}}}
    assert meta.acp_session_id is None
    assert SessionMetadata.new().data["runtime_config"] is not meta.data["runtime_config"]  # never shared


def test_load_copies_and_save_writes_back_whole_keeping_unknown_keys() -> None:
    stored = {"acp": {"session_id": "tok", "extra": 1}, "future_key": [1, 2]}
    session = _session(stored)
    meta = SessionMetadata.load(session)
    meta.set_acp_session_id("new")
    assert stored["acp"]["session_id"] == "tok"  # the stored object is not edited in place
    meta.save(session)
    assert session.metadata_json == {"acp": {"session_id": "new", "extra": 1}, "future_key": [1, 2]}


def test_a_missing_or_null_object_reads_as_empty() -> None:
    for stored in (None, {}):
        meta = SessionMetadata.load(_session(stored))
        assert meta.acp_session_id is None
        assert meta.runtime_config is None
        assert meta.runtime_config_or_empty() == {"model": None, "mode": None, "options": {}}
        assert meta.git_credential_snapshot == {}
        assert meta.to_json() == {}


def test_wiping_the_token_keeps_the_acp_record() -> None:
    meta = SessionMetadata({"acp": {"session_id": "tok"}})
    meta.set_acp_session_id(None)
    assert meta.to_json() == {"acp": {"session_id": None}}


def test_status_records_are_replaced_or_updated() -> None:
    meta = SessionMetadata({})
    meta.set_resume(status="starting", fresh=False)
    meta.set_resume(status="failed", error="boom")
    assert meta.data["resume"] == {"status": "failed", "error": "boom"}
    meta.set_context_reset(status="resetting", origin="reset-context")
    meta.update_context_reset(status="restoring", path="acp")
    assert meta.data["context_reset"] == {"status": "restoring", "origin": "reset-context", "path": "acp"}
