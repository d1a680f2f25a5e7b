"""daemon.store.space and daemon.backend.lifetime.store_care: a full disk recognised and reported once (from a
failed write, or from the free space alone), retention and vacuum on a real SQLite store (Issue 21 item 5,
Issue 24 item 2, Issue 45 item 3)."""

from __future__ import annotations

import errno
import logging
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError

from daemon.backend.lifetime.store_care import StoreCare
from daemon.config.keys import ConfigError
from daemon.config.settings import load_config, validate_backend
from daemon.store import space, transcript
from daemon.store.db import Store
from daemon.store.space import CLEAR_BYTES, LOW_BYTES, SpaceWatch, is_out_of_space
from tests.support.aio import run
from tests.support.store_rows import new_session


def _sqlite_error(name: str) -> OperationalError:
    orig = sqlite3.OperationalError("database or disk is full")
    orig.sqlite_errorname = name  # type: ignore[attr-defined]
    return OperationalError("INSERT ...", {}, orig)


def test_what_counts_as_out_of_space(tmp_path: Path) -> None:
    assert is_out_of_space(_sqlite_error("SQLITE_FULL"), tmp_path)
    assert is_out_of_space(OSError(errno.ENOSPC, "No space left on device"), None)
    wrapped = RuntimeError("batch failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_out_of_space(wrapped, None)
    # an I/O error is a full disk only where (almost) no byte is free
    assert not is_out_of_space(_sqlite_error("SQLITE_IOERR_SHMSIZE"), tmp_path)
    assert not is_out_of_space(_sqlite_error("SQLITE_BUSY"), tmp_path)
    assert not is_out_of_space(ValueError("bad input"), tmp_path)


def test_out_of_space_is_reported_once_and_cleared(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 21 item 5: the journal says store_out_of_space (path, free bytes) once per episode, and
    store_space_back when a write succeeds again; status carries the episode meanwhile."""
    watch = SpaceWatch(tmp_path / "kandev.db")
    caplog.set_level(logging.INFO)
    assert watch.failed(_sqlite_error("SQLITE_FULL")) and watch.failed(_sqlite_error("SQLITE_FULL"))
    assert not watch.failed(ValueError("not about space"))
    events = [(r.kandev_event, r.kandev_fields) for r in caplog.records if hasattr(r, "kandev_event")]
    assert [e for e, _ in events] == ["store_out_of_space"]
    assert events[0][1]["PATH"] == str(tmp_path / "kandev.db") and int(events[0][1]["FREE_BYTES"]) >= 0
    status = watch.status()
    assert status is not None and status["path"] == str(tmp_path / "kandev.db")
    watch.succeeded()
    assert watch.status() is None and not watch.out_of_space
    assert [r.kandev_event for r in caplog.records if hasattr(r, "kandev_event")][-1] == "store_space_back"
    run(watch.wait_for_space())  # not out of space: returns at once


def _events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.kandev_event for r in caplog.records if hasattr(r, "kandev_event")]


def test_no_free_space_is_reported_without_a_failed_write(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45 item 3: a home with (almost) no free byte is out of space even though no store write
    failed (an agent waiting for space stalls its turn, and the store is then not written at all);
    writes that still succeed (root's reserve) do not end the episode, only room again does, with
    some margin so that a filesystem hovering at the bound does not flap."""
    store, home = tmp_path / "store" / "kandev.db", tmp_path / "home"
    free = {store: 10 * CLEAR_BYTES, home: 10 * CLEAR_BYTES}
    monkeypatch.setattr(space, "free_bytes", lambda p: free[p])
    caplog.set_level(logging.INFO)
    watch = SpaceWatch(store, home)
    assert not watch.check_free() and watch.status() is None
    free[home] = LOW_BYTES - 1
    assert watch.check_free() and watch.check_free()
    status = watch.status()
    assert status is not None and status["path"] == str(home) and status["cause"] == "no_free_space"
    assert status["free_bytes"] == LOW_BYTES - 1
    watch.succeeded()  # the store still takes writes: still out of space
    free[home] = LOW_BYTES + 1
    watch.succeeded()  # above the bound, but not by the margin
    assert watch.out_of_space and watch.check_free()
    free[home] = CLEAR_BYTES
    run(watch.wait_for_space())  # room again: returns (at once)
    watch.succeeded()
    assert watch.status() is None and not watch.check_free()
    assert _events(caplog) == ["store_out_of_space", "store_space_back"]


def test_a_failed_write_ends_with_the_next_write_that_succeeds(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 21 item 5 with Issue 45 item 3's watch: an episode begun by a failed write ends with a
    write that succeeds, once every watched filesystem has more than ``LOW_BYTES`` free."""
    store = tmp_path / "kandev.db"
    free = {store: 0}
    monkeypatch.setattr(space, "free_bytes", lambda p: free[p])
    caplog.set_level(logging.INFO)
    watch = SpaceWatch(store, tmp_path)
    assert watch.watched == [store, tmp_path]
    free[tmp_path] = 10 * CLEAR_BYTES
    assert watch.failed(_sqlite_error("SQLITE_FULL"))
    assert (watch.status() or {}).get("cause") == "write_failed"
    watch.succeeded()  # a write that fit, on a filesystem still full
    assert watch.out_of_space
    free[store] = LOW_BYTES
    watch.succeeded()
    assert not watch.out_of_space and _events(caplog) == ["store_out_of_space", "store_space_back"]


def test_retention_removes_old_entries_and_vacuum_gives_space_back(store: Store) -> None:
    """Issue 24 item 2: entries older than the retention go; vacuum shrinks the file; status has the size."""
    sid = new_session(store)
    old = datetime.now(UTC) - timedelta(days=100)
    for start in range(0, 4000, 400):
        with store.session() as db:
            w = transcript.TranscriptWriter(db, sid)
            for _ in range(start, start + 400):
                w.append(role="system", kind="note", text="x" * 500, created_at=old)
    with store.session() as db:
        transcript.append(db, sid, role="system", kind="note", text="recent")
    care = StoreCare(store, retention_s=90 * 86400.0)
    status = run(care.status())
    before = status["bytes"]
    assert before > 2_000_000 and status["out_of_space"] is None and status["path"].endswith("kandev.db")
    assert care.apply_retention() == 4000
    with store.session() as db:
        assert [c.text for c in transcript.chunks_after(db, sid, 0)] == ["recent"]
    result = care.vacuum()
    assert result["bytes_before"] >= result["bytes_after"] and result["bytes_after"] < before / 4, result
    with store.session() as db:  # still writable, cursors go on
        assert transcript.append(db, sid, role="system", kind="note", text="after") == 4002


def test_retention_setting_is_range_checked(tmp_path: Path) -> None:
    """store.transcript_retention: a duration of 1h..36500d, days allowed; out of range is refused naming it."""
    config = load_config(None, {"KANDEV_STORE_TRANSCRIPT_RETENTION": "90d"})
    assert config.store.transcript_retention == 90 * 86400.0
    validate_backend(config)
    assert load_config(None, {}).store.transcript_retention is None  # default: keep everything
    with pytest.raises(ConfigError, match="store.transcript_retention"):
        validate_backend(load_config(None, {"KANDEV_STORE_TRANSCRIPT_RETENTION": "10min"}))
