"""Benchmark: a ``kandev`` call as a whole process against the interpreter's own start, and
``kandev down`` of an idle backend (Issue 24 item 3, Issue 24 item 4).

Run from the repository root: ``python tests/bench/bench_cli.py [-n N]``.

In one run, with the same interpreter (this one):

- baseline: ``python -c pass`` (the interpreter starting and exiting, ``site`` included);
- ``kandev --json status`` against an idle backend of a throwaway home, and ``kandev --help``,
  each the whole process through the ``kandev`` entry point next to this interpreter;

interleaved (baseline, status, help, baseline, ...) so that noise hits each alike; the medians
give ``ratio cli / interpreter start: <x>`` (the slower of the two commands; the goal is <= 1.5).
``kandev status`` (the same call printed for people) is timed and printed too, outside the ratio.
For scale, the same rounds time the interpreter importing only the modules any JSON client of a
Unix socket needs (``_json``, ``_socket``: the CLI speaks JSON to the backend, ipc/codec_json.py),
printed as ``ratio library floor / interpreter start: <x>``: the part of the ratio that is not
kandev's code; and, as msgpack's price, the same with ``msgpack`` (which the CLI loaded before
release 0.3.0: it brings datetime and collections). Both commands take the CLI's quick path
(daemon/cli/quick.py); ``kandev status`` takes the full one (argparse, the views).
Then ``kandev down`` of an idle backend (no agent), started afresh each time, as a whole
process: ``down seconds: <s>`` (the median; the goal is <= 0.5). The exit status is 0 either way
(a benchmark is a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOOR = "python -c import _json, _socket"
MSGPACK = "python -c import msgpack, _socket"


def _kandev() -> list[str]:
    """The installed entry point next to this interpreter (what a user runs), else the module."""
    script = Path(sys.executable).parent / "kandev"
    return [str(script)] if script.exists() else [sys.executable, "-m", "daemon.cli"]


def _env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEV_")}
    env.pop("NOTIFY_SOCKET", None)
    env["KANDEV_CONFIG"] = str(config)  # never the host's /etc/kandev
    return env


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    p = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT)
    took = time.perf_counter() - start
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}")
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=30, help="rounds of each command (default 30)")
    parser.add_argument("--downs", type=int, default=5, help="backends started and stopped (default 5)")
    args, _ = parser.parse_known_args(argv)
    kandev = _kandev()
    with tempfile.TemporaryDirectory(prefix="kd-bench-", dir="/var/tmp") as d:
        os.chmod(d, 0o700)
        config = Path(d) / "kandev.toml"
        config.write_text("")
        env = _env(config)
        home = ["--home", str(Path(d) / "home")]
        _timed([*kandev, *home, "up"], env)
        try:
            runs: dict[str, list[float]] = {"python -c pass": [], FLOOR: [], MSGPACK: [],
                                            "kandev --json status": [], "kandev --help": [], "kandev status": []}
            commands = {"python -c pass": [sys.executable, "-c", "pass"],
                        FLOOR: [sys.executable, "-c", FLOOR.removeprefix("python -c ")],
                        MSGPACK: [sys.executable, "-c", MSGPACK.removeprefix("python -c ")],
                        "kandev --json status": [*kandev, *home, "--json", "status"],
                        "kandev --help": [*kandev, "--help"],
                        "kandev status": [*kandev, *home, "status"]}
            for command in commands.values():  # warm the page cache and the bytecode once
                _timed(command, env)
            for _ in range(args.n):
                for name, command in commands.items():
                    runs[name].append(_timed(command, env))
        finally:
            _timed([*kandev, *home, "down"], env)
        medians = {name: statistics.median(times) for name, times in runs.items()}
        base = medians["python -c pass"]
        for name, median in medians.items():
            print(f"{name}: median {median * 1000:.1f} ms, best {min(runs[name]) * 1000:.1f} ms ({args.n} runs)")
        for name in ("kandev --json status", "kandev --help", "kandev status"):
            print(f"  {name} / python -c pass: {medians[name] / base:.2f}")
        print(f"ratio library floor / interpreter start: {medians[FLOOR] / base:.2f}   ({FLOOR})")
        print(f"  for scale, msgpack's: {medians[MSGPACK] / base:.2f}   ({MSGPACK})")
        ratio = max(medians["kandev --json status"], medians["kandev --help"]) / base
        print(f"ratio cli / interpreter start: {ratio:.2f}   (goal <= 1.5: {'PASS' if ratio <= 1.5 else 'FAIL'})")

        downs = []
        for _ in range(args.downs):
            _timed([*kandev, *home, "up"], env)
            downs.append(_timed([*kandev, *home, "down"], env))
        down = statistics.median(downs)
        print(f"kandev down of an idle backend: {', '.join(f'{s:.2f}' for s in downs)} s")
        print(f"down seconds: {down:.2f}   (goal <= 0.5: {'PASS' if down <= 0.5 else 'FAIL'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
