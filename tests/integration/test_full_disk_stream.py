"""A full disk is visible while a turn streams (Issue 45 scenario C, Issue 45 item 3): real backend,
control server and mock agent, the kandev home on a 64 MiB ext4 filesystem loop-mounted for the test.

Why it used to go unseen: the backend learnt of a full disk only from a store write that failed.
While a turn streams, the agent writes too (the mock records every chunk in its session's state
directory, under the home, as a real agent keeps its own session files); when that write finds no
space the agent waits for space, the stream stops, and the backend has nothing left to write, so
nothing ever fails: ``kandev status`` showed ``free_bytes: 0`` and ``out_of_space: null``, no journal
event, nothing on the board, for as long as the disk stayed full. Here that happens every time:
ext4 keeps 5 % of its blocks for root, the filler leaves only part of them, so the agent (never
root) finds the filesystem full while the root-run backend's store still takes every write.

The backend now watches the free space itself: within 10 s of the disk filling, ``kandev status``
(``store.out_of_space``, and a line in the human status), the board's header and the journal
(``store_out_of_space``) say so; within 10 s of space returning it clears (``store_space_back``),
and the turn completes with every one of its 20,000 chunks exactly once and in order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.disk import Filler, free_bytes, small_ext4
from tests.support.kandev import Kandev, db_row, make_env
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="loop-mounting a filesystem needs root"),
]

N = 20_000
SLACK = 1024 * 1024  # what the filler leaves: less than root's reserve (3.2 MiB), so the agents get none
FULL = 64 * 1024  # free bytes (for anyone but root) below which the filesystem counts as full
REPORT_S = 10.0  # status says so within this long after the disk filled, and clears within this long
# after space returned (the acceptance bound)


@pytest.fixture
def ext4_home(short_tmp: Path) -> Iterator[tuple[Kandev, Filler]]:
    """A Kandev home on a 64 MiB ext4 filesystem; the home is cleaned up before the unmount."""
    with small_ext4(short_tmp / "fs", short_tmp / "fs.img", "64M") as fs:
        config = short_tmp / "kandev.toml"
        config.write_text("")
        k = Kandev(fs / "home", make_env(config))
        filler = Filler(fs)
        try:
            yield k, filler
        finally:
            filler.free()
            k.cleanup()


def _out_of_space(k: Kandev) -> dict[str, Any] | None:
    full: dict[str, Any] | None = (k.status().get("store") or {}).get("out_of_space")
    return full


def _stored_chunks(k: Kandev) -> int:
    """Transcript cursors handed out so far (the prompt's entry, then one per chunk)."""
    row = db_row(k, "SELECT coalesce(max(last_cursor), 0) AS n FROM transcript_sessions")
    return int(row["n"]) if row else 0


def _logged(k: Kandev, event: str) -> int:
    """How many times the backend's journal (its log file here) recorded ``event``."""
    log = k.home / "logs" / "backend.log"
    return sum(f" {event} " in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0


def test_scenario_c_disk_fills_while_a_turn_streams(ext4_home: tuple[Kandev, Filler]) -> None:
    """Issue 45 scenario C: the home fills during ``/flood 20000`` (the agent stalls, no store write
    fails): status, board and journal say so within 10 s and clear within 10 s of space returning;
    every chunk arrives once and in order."""
    k, filler = ext4_home
    backend = int(k.up()["backend"]["pid"])
    _, sid = k.start_session("flood")
    k.cli("prompt", sid, f"/flood {N}")
    wait_until(lambda: _stored_chunks(k) > 2_000, timeout=120, message="the flood never started")
    assert _out_of_space(k) is None

    filler.fill(leave=SLACK)
    full_at = time.monotonic()
    assert free_bytes(filler.path.parent) < FULL  # full for the agents; root's store still has SLACK
    report = wait_until(lambda: _out_of_space(k), timeout=REPORT_S + 5, interval=0.2,
                        message="status never said the store is out of space")
    assert time.monotonic() - full_at <= REPORT_S, "status took too long to say the disk is full"
    assert report["free_bytes"] < FULL and Path(report["path"]).is_relative_to(filler.path.parent), report

    # While full: the turn waits (the agent waits for space), and every view says why.
    stalled_at = _stored_chunks(k)
    assert stalled_at < N and k.show(sid)["state"] == "RUNNING"
    assert "out of space" in k.human("status").stdout
    board = k.human("board").stdout
    assert "out of space" in board.splitlines()[0], board
    wait_until(lambda: _logged(k, "store_out_of_space") == 1, timeout=REPORT_S, message="no store_out_of_space event")

    filler.free()
    freed_at = time.monotonic()
    wait_until(lambda: _out_of_space(k) is None, timeout=REPORT_S + 5, interval=0.2,
               message="the out-of-space warning never cleared")
    assert time.monotonic() - freed_at <= REPORT_S, "the warning took too long to clear"
    wait_until(lambda: _logged(k, "store_space_back") == 1, timeout=REPORT_S, message="no store_space_back event")
    assert "out of space" not in k.human("board").stdout

    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=300,
                      interval=0.5, message="the turn never completed once space was back")
    assert [(t["state"], t["stop_reason"]) for t in done["turns"]] == [("finished", "end_turn")]
    chunks = [e["text"] for e in k.transcript(sid) if e["kind"] == "agent_message_chunk"]
    assert chunks == [f"{i}/{N} " for i in range(1, N + 1)]
    assert _logged(k, "store_out_of_space") == 1  # one episode, reported once
    assert int(k.status()["backend"]["pid"]) == backend
