"""Benchmark: a prompt to a session on another host against one to a local session (Issue 47 item 8).

Run from the repository root: ``python tests/bench/bench_remote_prompt.py [-n N]``.

In one run: a throwaway PostgreSQL server (tests/support/postgres.py) and two kandev homes on this
machine as the hosts ``a`` and ``b`` of one database, each with its backend and control server,
each with one idle mock-agent session. On ``a``'s socket (the call ``kandev prompt --wait`` makes,
without the CLI's interpreter start, which both kinds pay alike) ``prompt ... wait`` alternates
between ``a``'s own session and ``b``'s (which ``a`` hands to ``b`` through the store: a request
row, NOTIFY, ``b`` claims it, runs the prompt, writes the answer, NOTIFY), so noise hits both alike.
The medians give ``remote prompt overhead ms: X.X`` (remote minus local; the goal is <= 100 ms),
next to the local median itself. The exit status is 0 either way (a measurement, not a gate).
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
sys.path.insert(0, str(REPO_ROOT))

from daemon.cli.call import call  # noqa: E402
from daemon.host.home import backend_socket_path  # noqa: E402
from tests.support.postgres import PgCluster, server_bin  # noqa: E402


def _env(config: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEV_")}
    env.pop("NOTIFY_SOCKET", None)
    env["KANDEV_CONFIG"] = str(config)  # never the host's /etc/kandev
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _kandev(home: Path, env: dict[str, str], *args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    if p.returncode != 0:
        raise SystemExit(f"kandev {' '.join(args)} exited {p.returncode}: {p.stderr[-2000:]}")


def _waiting(sock: str, sid: str) -> None:
    deadline = time.monotonic() + 120
    while call(sock, "session_show", {"session_id": sid, "tail": 1})["state"] != "WAITING_FOR_INPUT":
        if time.monotonic() > deadline:
            raise SystemExit(f"session {sid} never waited for input")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=30, help="prompts to each session (default 30)")
    args, _ = parser.parse_known_args(argv)
    bindir = server_bin()
    if bindir is None:
        print("remote prompt overhead ms: NOT MEASURED (no PostgreSQL server installed)")
        return 0
    pg = PgCluster(bindir).start()
    homes: list[tuple[Path, dict[str, str]]] = []
    try:
        url = pg.new_database()
        with tempfile.TemporaryDirectory(prefix="kd-bench-", dir="/var/tmp") as d:
            os.chmod(d, 0o700)
            for host in ("a", "b"):
                config = Path(d) / f"{host}.toml"
                config.write_text(f'[database]\nurl = "{url}"\n[cluster]\nhost = "{host}"\n')
                homes.append((Path(d) / host, _env(config)))
                _kandev(*homes[-1], "up")
            (home_a, _), _ = homes
            sock = str(backend_socket_path(str(home_a)))
            task = call(sock, "task_create", {"title": "bench"})["task_id"]
            local = call(sock, "session_start", {"task_id": task}, timeout=180)["session_id"]
            remote = call(sock, "session_start", {"task_id": task, "host": "b"}, timeout=180)["session_id"]
            _waiting(sock, local)
            _waiting(sock, remote)
            times: dict[str, list[float]] = {"local": [], "remote": []}
            for i in range(args.n + 2):
                for kind, sid in (("local", local), ("remote", remote)):
                    start = time.perf_counter()
                    call(sock, "prompt", {"session_id": sid, "text": f"p{i}", "wait": True}, timeout=120)
                    took = time.perf_counter() - start
                    if i >= 2:  # the first two rounds warm both paths up
                        times[kind].append(took)
            loc, rem = statistics.median(times["local"]), statistics.median(times["remote"])
            print(f"prompt --wait to a local session, median ms: {loc * 1000:.1f} (n={len(times['local'])})")
            print(f"prompt --wait to a session on another host, median ms: {rem * 1000:.1f}")
            print(f"remote prompt overhead ms: {(rem - loc) * 1000:.1f}")
            for home, env in homes:
                _kandev(home, env, "down", "--agents")
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
