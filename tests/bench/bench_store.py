"""Benchmark: store bytes per streamed chunk, and ``session show`` of the last page (Issue 24 item 1).

Run: ``python tests/bench/bench_store.py [N]`` (or ``bash packaging/dev/bench.sh``); N defaults to
100,000.

A fresh home; one mock session runs ``/flood N`` through the control server into the backend's
SQLite store. The figure is the growth of ``kandev.db`` plus its write-ahead log (measured with the
backend still running, as an operator sees the directory) divided by N. The baseline printed next
to it is the chunks' own text (what a transcript cannot do without). Then ``kandev session show``
of the session's last page (the real CLI, interpreter start included, best of three) and a walk of
the whole transcript with ``--after-seq`` check that every chunk is there, once and in order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
GOAL_BYTES = 50


def kandev(home: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
        capture_output=True, text=True, env=env, timeout=900, check=True,
    )
    return json.loads(out.stdout)


def store_bytes(home: Path) -> int:
    return sum(p.stat().st_size for p in (home / "kandev.db", home / "kandev.db-wal") if p.exists())


def walk(home: Path, env: dict[str, str], sid: str) -> list[str]:
    """Every agent chunk of the transcript, paged forward with ``--after-seq``."""
    texts: list[str] = []
    cursor = 0
    while True:
        show = kandev(home, env, "session", "show", sid, "--after-seq", str(cursor), "--limit", "10000")
        texts += [e["text"] for e in show["transcript"] if e["kind"] == "agent_message_chunk"]
        if not show["page"]["more_after"]:
            return texts
        cursor = show["page"]["next_cursor"]


def measure(n: int, workdir: Path) -> tuple[int, int, float]:
    home = workdir / "home"
    config = workdir / "kandev.toml"
    config.write_text("")
    env = dict(os.environ, PYTHONPATH=str(REPO), KANDEV_CONFIG=str(config))
    st = kandev(home, env, "up")["status"]
    try:
        task = kandev(home, env, "task", "create", "--title", "flood")["task_id"]
        sid = kandev(home, env, "session", "start", task)["session_id"]
        before = store_bytes(home)
        kandev(home, env, "prompt", sid, f"/flood {n}", "--wait")
        grown = store_bytes(home) - before
        timings = []
        for _ in range(3):
            t0 = time.perf_counter()
            kandev(home, env, "session", "show", sid)
            timings.append(time.perf_counter() - t0)
        expected = [f"{i}/{n} " for i in range(1, n + 1)]
        texts = walk(home, env, sid)
        assert texts == expected, f"lost, duplicated or reordered: {len(texts)} of {n}"
        return grown, sum(len(t.encode()) for t in expected), min(timings)
    finally:
        subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "down"], env=env,
                       capture_output=True, timeout=60)
        ctl = st["control_server"]["pid"]
        if ctl:
            try:
                os.kill(ctl, signal.SIGTERM)
            except ProcessLookupError:
                pass


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory(prefix="kd-bench-", dir="/var/tmp") as d:
        workdir = Path(d)
        os.chmod(workdir, 0o700)
        grown, text_bytes, show_s = measure(n, workdir)
    per_chunk = grown / n
    print(f"store N={n} (kandev.db + WAL growth: {grown} bytes; every chunk stored once, in order)")
    print(f"  baseline, the chunks' own text: {text_bytes / n:.1f} bytes per chunk")
    print(f"  store bytes per chunk: {per_chunk:.1f}")
    print(f"  ratio store / text: {per_chunk / (text_bytes / n):.2f}")
    print(f"  session show last page seconds: {show_s:.3f}")
    print(f"  goal <= {GOAL_BYTES} bytes per chunk: {'PASS' if per_chunk <= GOAL_BYTES else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
