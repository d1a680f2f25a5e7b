"""daemon.core.journal: structured entries to journald, or lines to stderr and the bounded file."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.core import journal
from daemon.core.journal import BoundedFileHandler, log_event, setup_logging

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?P<level>[A-Z]+) (?P<comp>\S+) (?P<rest>.*)$")


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def _setup(tmp_path: Path, **kw: Any) -> Path:
    log = tmp_path / "logs" / "agentctl.log"
    setup_logging("agentctl", log_file=log, file_max_bytes=10_000, file_backups=2, file_max_age_days=14, **kw)
    return log


def test_journal_test_file_line_format(tmp_path: Path) -> None:
    log = _setup(tmp_path, use_journal=False)
    log_event("session_state", "moved to RUNNING", SESSION_ID="s1", TASK_ID="t1", REASON="a b", INSTANCE_ID=None,
              SEQ=7)
    log_event("unowned_shutdown", "bye", priority=4)
    lines = log.read_text().splitlines()
    m = LINE.match(lines[0])
    assert m and m["level"] == "INFO" and m["comp"] == "agentctl"
    assert m["rest"] == 'session_state session_id=s1 task_id=t1 reason="a b" seq=7 msg="moved to RUNNING"'
    m = LINE.match(lines[1])
    assert m and m["level"] == "WARNING" and m["rest"] == "unowned_shutdown msg=bye"


def test_journal_plain_records_in_file(tmp_path: Path) -> None:
    log = _setup(tmp_path, use_journal=False)
    logging.getLogger("daemon.x").warning("hello %s", "there")
    m = LINE.match(log.read_text().splitlines()[0])
    assert m and m["rest"] == "daemon.x: hello there"


def test_journal_file_lines_carry_no_control_sequence(tmp_path: Path) -> None:
    """What an agent wrote reaches log lines (its errors, its stderr tail): a `tail -f` of the file
    must not obey it. Fields and messages have their control characters escaped; a plain
    message keeps its newlines (kandev's own task dumps are several lines)."""
    log = _setup(tmp_path, use_journal=False)
    log_event("agent_gone", "stderr: \x1b]52;c;eA==\x07", REASON="x\x1b[2J\x9by")
    logging.getLogger("daemon.x").warning("agent said %s", "a\x1b[1A\rb\x9bc\nnext")
    text = log.read_text()
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text), repr(text)
    assert 'reason="x\\u001b[2J\\u009by" msg="stderr: \\u001b]52;c;eA==\\u0007"' in text
    assert "daemon.x: agent said a\\u001b[1A\\u000db\\u009bc\nnext" in text


def test_journal_fields_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, dict[str, str]]] = []
    monkeypatch.setattr(journal, "_journal_send", lambda message, **fields: sent.append((message, fields)))
    setup_logging("backend", use_journal=True)
    log_event("adoption", "adopted", SESSION_ID="s1", reason="ok", TASK_ID=None, priority=5)
    (message, fields), = sent
    assert message == "adopted"
    assert fields["KANDEV_EVENT"] == "adoption" and fields["KANDEV_COMPONENT"] == "backend"
    assert fields["SESSION_ID"] == "s1" and fields["REASON"] == "ok" and "TASK_ID" not in fields
    assert fields["PRIORITY"] == "5" and fields["SYSLOG_IDENTIFIER"] == "kandev-backend"


def test_journal_invalid_field_name_refused() -> None:
    with pytest.raises(ValueError):
        log_event("x", "y", **{"bad-name": "v"})
    with pytest.raises(ValueError):
        log_event("x", "y", KANDEV_EVENT="spoof")


def test_journal_file_bounds_required(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="> 0"):
        setup_logging("agentctl", log_file=tmp_path / "a.log", file_max_bytes=0, file_backups=5,
                      file_max_age_days=14, use_journal=False)


def test_journal_file_rotation_and_age_pruning(tmp_path: Path) -> None:
    log = tmp_path / "agentctl.log"
    old = tmp_path / "agentctl.log.2"
    old.write_text("old\n")
    past = time.time() - 30 * 86400
    os.utime(old, (past, past))
    keep = tmp_path / "agentctl.log.keep"
    keep.write_text("not a rotated file\n")
    handler = BoundedFileHandler(log, max_bytes=200, backups=2, max_age_days=14)
    assert not old.exists() and keep.exists()
    logger = logging.getLogger("kandev.test.rotation")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(50):
            logger.warning("line %03d %s", i, "x" * 40)
    finally:
        logger.removeHandler(handler)
        handler.close()
    rotated = sorted(p.name for p in tmp_path.glob("agentctl.log.[0-9]*"))
    assert rotated == ["agentctl.log.1", "agentctl.log.2"]
    assert all(p.stat().st_size <= 200 for p in tmp_path.glob("agentctl.log*") if p != keep)
