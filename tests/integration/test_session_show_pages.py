"""``kandev session show`` pages its transcript (Issue 10 item 8): real backend, mock agent, real CLI.

One session floods 100,000 chunks (about 10 MB of transcript: more than one 8 MiB frame holds);
``session show`` still answers, quickly, with its last page, and ``--after-seq``/``--limit``
walk the whole transcript exactly once, in order.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.kandev import Kandev, make_env
from tests.support.streams import agent_chunks

pytestmark = pytest.mark.timeout(600)

CHUNKS = 100_000
PAGE = 10_000  # session show's default page: its last 10,000 entries
# The scenario's "within a second" is the reference machine's figure; a test never asserts
# wall-clock speed. What the figure means is that the last page costs what a page costs, whatever
# the transcript's size: so the huge transcript's last page is held to a ratio of the same CLI call
# for the last page of a session holding just one page (the same 10,000 chunks to fetch, decode and
# print), measured in the same run. A show that read the whole transcript would take about ten times
# as long for the huge one; pages of the same size vary by far less than the bound between calls.
SHOW_RATIO_BOUND = 3.0


@pytest.fixture(scope="module")
def flooded():
    """One backend (shared by this module) and ``(kandev, sid, small_sid)``: a session whose
    transcript holds /flood 100000, and one that holds a single page of chunks, /flood 10000."""
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d:
        root = Path(d)
        root.chmod(0o700)
        config = root / "home.toml"
        config.write_text("")
        k = Kandev(root / "home", make_env(config))
        try:
            k.up()
            yield k, _flooded_session(k, "flood", CHUNKS, 540), _flooded_session(k, "one page", PAGE, 120)
        finally:
            k.cleanup()


def _flooded_session(k: Kandev, title: str, chunks: int, timeout: float) -> str:
    """A new session whose one turn, ``/flood chunks``, has ended."""
    _, sid = k.start_session(title)
    done = k.cli("prompt", sid, f"/flood {chunks}", "--wait", timeout=timeout)
    assert done["stop_reason"] == "end_turn"
    return sid


def _timed_show(k, sid: str, *flags: str) -> tuple[float, dict]:
    start = time.monotonic()
    proc = k.run("session", "show", sid, *flags)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    return elapsed, json.loads(proc.stdout)


def test_scenario_f_last_page_of_a_huge_transcript_costs_about_a_small_one(flooded):
    """Issue 10 scenario F: after ``/flood 100000``, ``kandev session show SID`` returns its last page
    (the real CLI, interpreter start included) at most SHOW_RATIO_BOUND times the time of the same
    call for the same-sized last page of a session ten times smaller, and never fails with
    ``frame_too_large``. Best of three interleaved calls each, so a momentary stall of a shared
    machine does not decide it."""
    k, sid, small_sid = flooded
    timings, small = [], []
    for _ in range(3):
        elapsed, small_show = _timed_show(k, small_sid)
        small.append(elapsed)
        elapsed, show = _timed_show(k, sid)
        timings.append(elapsed)
    print(f"\nsession show, last page of {CHUNKS} chunks: " + ", ".join(f"{t:.2f} s" for t in timings)
          + f"; last page of {PAGE} chunks: " + ", ".join(f"{t:.2f} s" for t in small))
    assert show["page"]["count"] == small_show["page"]["count"] == PAGE  # the same page size
    assert agent_chunks(small_show)[-1] == f"{PAGE}/{PAGE} "
    assert min(timings) <= SHOW_RATIO_BOUND * min(small), (timings, small)
    chunks = agent_chunks(show)
    assert chunks[-1] == f"{CHUNKS}/{CHUNKS} "
    first = CHUNKS - len(chunks) + 1
    assert chunks == [f"{i}/{CHUNKS} " for i in range(first, CHUNKS + 1)]  # the newest, in order
    page = show["page"]
    assert page["more_before"] is True and page["more_after"] is False
    assert page["count"] == len(show["transcript"]) <= 10_000
    assert page["total"] >= CHUNKS + 1  # the prompt and every chunk
    assert page["next_cursor"] == show["transcript"][-1]["cursor"]
    assert show["turns"][-1]["stop_reason"] == "end_turn" and show["turns_total"] == 1

    elapsed, tail = _timed_show(k, sid, "--tail", "3")
    assert agent_chunks(tail) == [f"{i}/{CHUNKS} " for i in range(CHUNKS - 2, CHUNKS + 1)]


def test_after_seq_walks_the_whole_transcript_once_in_order(flooded):
    k, sid, _ = flooded
    cursor, texts, pages = 0, [], 0
    while True:
        _, show = _timed_show(k, sid, "--after-seq", str(cursor), "--limit", "10000")
        pages += 1
        cursors = [m["cursor"] for m in show["transcript"]]
        assert cursors == sorted(cursors) and (not cursors or cursors[0] > cursor)
        texts.extend(agent_chunks(show))
        if not show["page"]["more_after"]:
            break
        cursor = show["page"]["next_cursor"]
    assert texts == [f"{i}/{CHUNKS} " for i in range(1, CHUNKS + 1)]
    assert pages == 11  # 100,001 entries, 10,000 a page
    _, end = _timed_show(k, sid, "--after-seq", str(show["page"]["next_cursor"]))
    assert end["transcript"] == [] and end["page"]["more_before"] is True


def test_page_flags_are_checked(flooded):
    k, sid, _ = flooded
    for flags in (["--tail", "0"], ["--tail", "10001"], ["--after-seq", "-1"], ["--limit", "5"],
                  ["--tail", "5", "--after-seq", "1"]):
        proc = k.run("session", "show", sid, *flags)
        assert proc.returncode == 2, (flags, proc.stderr)
