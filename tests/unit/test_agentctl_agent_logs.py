"""daemon.agentctl.instance.logs: the agents' stderr files stay bounded in size and in number (real files)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from daemon.agentctl.instance import logs as agent_logs


def _file(d: Path, name: str, data: bytes, age_s: float = 0.0) -> Path:
    p = d / name
    p.write_bytes(data)
    if age_s:
        t = time.time() - age_s
        os.utime(p, (t, t))
    return p


def test_cap_keeps_the_tail_from_a_line_boundary_after_a_marker(tmp_path: Path) -> None:
    lines = b"".join(b"line %06d\n" % i for i in range(2000))  # 24 000 bytes
    p = _file(tmp_path, "a.stderr.log", lines)
    dropped = agent_logs.cap(p, max_bytes=10_000, keep_bytes=1_000)
    text = p.read_bytes()
    marker, rest = text.split(b"\n", 1)
    assert marker.startswith(b"[kandev: ") and str(dropped).encode() in marker
    assert lines.endswith(rest) and rest.startswith(b"line ") and len(rest) <= 1_000
    assert dropped == len(lines) - len(rest)


def test_cap_leaves_small_files_alone(tmp_path: Path) -> None:
    p = _file(tmp_path, "a.stderr.log", b"x" * 100)
    assert agent_logs.cap(p, max_bytes=100, keep_bytes=10) == 0
    assert p.read_bytes() == b"x" * 100
    assert agent_logs.cap(tmp_path / "missing.stderr.log") == 0


def test_cap_never_follows_a_symlink(tmp_path: Path) -> None:
    target = _file(tmp_path, "precious", b"y" * 5000)
    link = tmp_path / "b.stderr.log"
    link.symlink_to(target)
    assert agent_logs.cap(link, max_bytes=100, keep_bytes=10) == 0
    assert target.read_bytes() == b"y" * 5000


def test_a_writer_holding_the_file_appends_after_the_cut(tmp_path: Path) -> None:
    """The agent keeps its O_APPEND descriptor: after the cut its next writes land at the new end."""
    p = tmp_path / "c.stderr.log"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, b"old\n" * 5000)
        agent_logs.cap(p, max_bytes=1000, keep_bytes=100)
        os.write(fd, b"new line\n")
    finally:
        os.close(fd)
    data = p.read_bytes()
    assert data.endswith(b"old\nnew line\n") and len(data) < 300


def test_prune_removes_only_old_unkept_regular_stderr_files(tmp_path: Path) -> None:
    old = 15 * 24 * 3600
    gone = _file(tmp_path, "old.stderr.log", b"1", age_s=old)
    kept_running = _file(tmp_path, "running.stderr.log", b"2", age_s=old)  # a quiet instance of this server
    recent = _file(tmp_path, "recent.stderr.log", b"3", age_s=3600)  # e.g. another server's agent
    other = _file(tmp_path, "notes.txt", b"4", age_s=old)
    target = _file(tmp_path, "target", b"5", age_s=old)
    link = tmp_path / "link.stderr.log"
    link.symlink_to(target)
    os.utime(link, (time.time() - old, time.time() - old), follow_symlinks=False)
    removed = agent_logs.prune(tmp_path, keep={kept_running})
    assert removed == [gone] and not gone.exists()
    assert kept_running.exists() and recent.exists() and other.exists() and link.is_symlink() and target.exists()
    assert agent_logs.prune(tmp_path / "missing", keep=set()) == []


def test_a_second_cut_does_not_count_the_first_cuts_marker_as_the_agents_bytes(tmp_path: Path) -> None:
    lines = b"".join(b"line %06d\n" % i for i in range(2000))
    p = _file(tmp_path, "d.stderr.log", lines)
    first = agent_logs.cap(p, max_bytes=10_000, keep_bytes=1_000)
    with open(p, "ab") as fh:
        fh.write(lines)  # the agent goes on writing
    kept_before = p.read_bytes().split(b"\n", 1)[1]
    second = agent_logs.cap(p, max_bytes=10_000, keep_bytes=1_000)
    rest = p.read_bytes().split(b"\n", 1)[1]
    assert first == len(lines) - len(kept_before.removesuffix(lines))
    assert second == len(kept_before) - len(rest)  # the agent's bytes only
