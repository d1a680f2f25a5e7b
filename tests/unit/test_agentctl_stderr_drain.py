"""daemon.agentctl.instance.stderr_drain: one thread drains every agent's stderr pipe into its bounded file
(real pipes, real files, a real thread)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from daemon.agentctl.instance.stderr_drain import StderrDrain, StderrSink
from tests.support.waiting import wait_until


def _pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    return r, w


def test_one_thread_drains_fifty_pipes_each_into_its_own_file_in_order(tmp_path: Path) -> None:
    threads_before = threading.active_count()
    drain = StderrDrain(open_files_max=4)
    sinks: list[tuple[StderrSink, int]] = []
    for i in range(50):
        r, w = _pipe()
        sinks.append((StderrSink(r, tmp_path / f"{i}.stderr.log", drain=drain).start(), w))
    assert threading.active_count() == threads_before + 1  # one drain thread, not one per agent
    for line in range(20):
        for i, (_sink, w) in enumerate(sinks):
            os.write(w, b"agent %d line %d\n" % (i, line))
    for _sink, w in sinks:
        os.close(w)
    for i, (sink, _w) in enumerate(sinks):
        assert sink.drained(10), i
        assert sink.read_fd == -1  # the pipe is closed at its end
        assert (tmp_path / f"{i}.stderr.log").read_bytes() == b"".join(b"agent %d line %d\n" % (i, n)
                                                                      for n in range(20))
    assert drain.open_files() == 0  # an ended sink's file is closed too


def test_at_most_open_files_max_files_stay_open_between_writes(tmp_path: Path) -> None:
    drain = StderrDrain(open_files_max=3)
    writers = []
    for i in range(10):
        r, w = _pipe()
        sink = StderrSink(r, tmp_path / f"{i}.stderr.log", drain=drain).start()
        os.write(w, b"hello\n")
        wait_until(lambda p=sink.path: p.exists() and p.read_bytes() == b"hello\n", timeout=10)
        assert drain.open_files() <= 3
        writers.append((sink, w))
    for sink, w in writers:  # a closed file is reopened (and appended to) when its agent writes again
        os.write(w, b"again\n")
        os.close(w)
        assert sink.drained(10)
        assert sink.path.read_bytes() == b"hello\nagain\n"


def test_a_file_is_cut_while_written_and_keeps_the_last_lines(tmp_path: Path) -> None:
    drain = StderrDrain()
    r, w = _pipe()
    sink = StderrSink(r, tmp_path / "a.stderr.log", max_bytes=10_000, keep_bytes=1_000, drain=drain).start()
    lines = b"".join(b"line %06d\n" % i for i in range(5_000))  # 60,000 bytes
    for start in range(0, len(lines), 1_200):
        os.write(w, lines[start:start + 1_200])
    os.close(w)
    assert sink.drained(10)
    data = sink.path.read_bytes()
    marker, rest = data.split(b"\n", 1)
    assert marker.startswith(b"[kandev: ") and b"cut" in marker
    assert len(data) <= 10_000 + len(marker) + 1 and lines.endswith(rest) and rest.startswith(b"line ")
    # The marker counts the agent's bytes cut, never an earlier cut's marker line.
    assert sink.cut_bytes == len(lines) - len(rest) and b"[kandev: %d earlier bytes" % sink.cut_bytes in marker


def test_pause_leaves_what_follows_in_the_pipe_for_the_next_sink(tmp_path: Path) -> None:
    drain = StderrDrain()
    r, w = _pipe()
    path = tmp_path / "a.stderr.log"
    sink = StderrSink(r, path, drain=drain).start()
    os.write(w, b"before\n")
    wait_until(lambda: path.exists() and path.read_bytes() == b"before\n", timeout=10)
    handed = sink.pause()
    assert handed == r
    os.write(w, b"waits\n")
    os.set_blocking(r, False)
    assert os.read(r, 100) == b"waits\n"  # the drain no longer reads a paused pipe
    os.set_blocking(r, True)
    taken_over = StderrSink(r, path, drain=drain).start()  # what a re-exec's new image does
    os.write(w, b"after\n")
    os.close(w)
    assert taken_over.drained(10)
    assert path.read_bytes() == b"before\nafter\n"


def test_close_stops_draining_and_closes_the_pipe(tmp_path: Path) -> None:
    drain = StderrDrain()
    r, w = _pipe()
    sink = StderrSink(r, tmp_path / "a.stderr.log", drain=drain).start()
    sink.close()
    assert sink.read_fd == -1 and not sink.eof
    with pytest.raises(BrokenPipeError):  # nobody holds the read end any more
        os.write(w, b"x")
    os.close(w)


def test_a_symlink_in_the_files_place_is_never_followed_and_the_pipe_still_drains(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    link = tmp_path / "a.stderr.log"
    link.symlink_to(target)
    drain = StderrDrain()
    r, w = _pipe()
    sink = StderrSink(r, link, drain=drain).start()
    caplog.set_level(logging.WARNING, logger="kandev.agentctl.agent_logs")
    written = 0
    while written < 256 * 1024:  # four times a pipe's buffer: blocks for ever unless drained
        written += os.write(w, b"y" * 4096)
    os.close(w)
    assert sink.drained(10)
    assert target.read_bytes() == b"keep" and link.is_symlink()
    warnings = [r.getMessage() for r in caplog.records if "dropped until" in r.getMessage()]
    assert len(warnings) == 1, warnings  # warned once, not once per chunk


def test_a_readiness_for_a_pipe_with_nothing_in_it_never_blocks_the_drain(tmp_path: Path) -> None:
    """The wait can report a pipe that was closed since, whose number a new agent's pipe then
    took: serving that new, empty pipe returns at once instead of holding the drain's lock."""
    drain = StderrDrain()
    r, w = _pipe()
    sink = StderrSink(r, tmp_path / "a.stderr.log", drain=drain).start()

    def serve_once() -> None:
        with drain._lock:
            drain._serve(sink)

    server = threading.Thread(target=serve_once, daemon=True)
    server.start()
    server.join(5)
    assert not server.is_alive()
    os.write(w, b"still drained\n")
    os.close(w)
    assert sink.drained(10) and sink.path.read_bytes() == b"still drained\n"
