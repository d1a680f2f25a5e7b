"""Persistence and failure switches of the mock agent (daemon/agents/mock/state.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from daemon.agents.mock.state import STATE_DIR_ENV, SessionRecord, read_switches, state_dir


def test_state_dir_is_env_override_else_under_session_cwd(monkeypatch, tmp_path):
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    assert state_dir("/ws") == Path("/ws/.kandev-mock/sessions")
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert state_dir("/ws") == tmp_path


def test_round_trip_keeps_state_and_history_in_order(monkeypatch, tmp_path):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    rec = SessionRecord(session_id=uuid.uuid4().hex, cwd="/ws")
    rec.save()
    rec.append("user", "hi")
    rec.append("agent", "echo: hi")
    rec.mode = "plan"
    rec.config["effort"] = "high"
    rec.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{rec.session_id}.json", f"{rec.session_id}.history.jsonl"]
    )  # no temporary files left behind
    loaded = SessionRecord.load(rec.session_id, "/ws")
    assert loaded == rec


def test_torn_history_line_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    rec = SessionRecord(session_id=uuid.uuid4().hex, cwd="/ws")
    rec.save()
    rec.append("agent", "1/2 ")
    with rec.history_path.open("a") as fh:
        fh.write('{"role": "agent", "te')
    loaded = SessionRecord.load(rec.session_id, "/ws")
    assert loaded is not None and [h.text for h in loaded.history] == ["1/2 "]


@pytest.mark.parametrize("session_id", ["0" * 32, "../../etc/passwd", ""])
def test_unknown_or_malformed_session_id_loads_nothing(monkeypatch, tmp_path, session_id):
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert SessionRecord.load(session_id, "/ws") is None


def test_switches_missing_invalid_and_set(tmp_path):
    assert read_switches(tmp_path) == {}
    (tmp_path / ".kandev-mock.toml").write_text("fail_load = [")
    assert read_switches(tmp_path) == {}
    (tmp_path / ".kandev-mock.toml").write_text('fail_load = true\nreject_option = "effort=high"\n')
    assert read_switches(tmp_path) == {"fail_load": True, "reject_option": "effort=high"}


def test_messages_join_each_run_of_one_role_and_split_long_runs(monkeypatch, tmp_path):
    """Issue 45 scenario A: what ``session/load`` replays is the history as messages (a run of one
    role's chunks joined, split past ``max_chars``, never inside a chunk), not one per chunk."""
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    rec = SessionRecord(session_id=uuid.uuid4().hex, cwd="/ws")
    rec.save()
    rec.append("user", "/flood 5")
    for i in range(1, 6):
        rec.append("agent", f"{i}/5 ")
    rec.append("user", "hi")
    rec.append("agent", "echo: hi")
    loaded = SessionRecord.load(rec.session_id, "/ws")
    assert loaded is not None and len(loaded.history) == 8
    assert [(m.role, m.text) for m in loaded.messages()] == [
        ("user", "/flood 5"), ("agent", "1/5 2/5 3/5 4/5 5/5 "), ("user", "hi"), ("agent", "echo: hi")]
    assert [(m.role, m.text) for m in loaded.messages(max_chars=8)] == [
        ("user", "/flood 5"), ("agent", "1/5 2/5 "), ("agent", "3/5 4/5 "), ("agent", "5/5 "),
        ("user", "hi"), ("agent", "echo: hi")]
    assert [m.text for m in loaded.messages(max_chars=2)][1:3] == ["1/5 ", "2/5 "]  # a chunk is never cut
    assert SessionRecord(session_id=uuid.uuid4().hex, cwd="/ws").messages() == []
