"""Benchmark: the board of a cluster against a single host's (Issue 47 item 8).

Run: ``python tests/bench/bench_cluster_board.py [N]`` (or ``bash packaging/dev/bench.sh``); N
sessions per host, default 100.

One PostgreSQL server (started as the tests start theirs: tests/support/postgres.py), two databases
of it. In one, a single host (no ``cluster.host``) whose store holds 3 x N tasks, each with one
session of three turns and a live inventory row; in the other, three hosts ``a``, ``b`` and ``c``
(three homes on this machine), each with N such sessions recorded as its own. The rows are written
into the stores directly, after each backend created and migrated its store: starting 300 agents
would measure the agents, not the board. The board is ``task_list``, the operation ``kandev board``
asks for (every task, its latest session, why it needs attention), asked over the backend's socket
the way the CLI asks it; on host ``a`` of the cluster, two thirds of the sessions are other hosts'
(their liveness read from the store and their hosts' heartbeats). Best of R rounds, the two boards
asked in turn in each round. The figure is the ratio of the cluster's board to the single host's
(goal <= 1.5).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.cli.call import call  # noqa: E402
from daemon.store.db import Store  # noqa: E402
from daemon.store.models import ExecutorRunning, Task, TaskSession, Turn  # noqa: E402
from tests.support.postgres import PgCluster, server_bin  # noqa: E402

GOAL = 1.5
ROUNDS = 15


def kandev(home: Path, env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
                          capture_output=True, text=True, env=env, timeout=600, check=True).stdout


def home_of(workdir: Path, name: str, url: str, host: str | None) -> tuple[Path, dict[str, str]]:
    config = workdir / f"{name}.toml"
    config.write_text(f'[database]\nurl = "{url}"\n' + (f'[cluster]\nhost = "{host}"\n' if host else ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEV_")}
    env.update(PYTHONPATH=str(REPO), KANDEV_CONFIG=str(config))
    return workdir / name, env


def fill(url: str, hosts: list[str | None], n: int) -> None:
    """N tasks per host, each with one session of three turns, waiting for input, its row live."""
    store = Store.open(url)
    now = datetime.now(UTC)
    try:
        with store.session() as db:
            for host in hosts:
                for i in range(n):
                    task = Task(title=f"task {i} of {host or 'the host'}", state="review", created_at=now,
                                updated_at=now)
                    db.add(task)
                    db.flush()
                    session = TaskSession(task_id=task.id, agent="mock", state="WAITING_FOR_INPUT", host=host,
                                          created_at=now, updated_at=now)
                    db.add(session)
                    db.flush()
                    for ordinal in (1, 2, 3):
                        db.add(Turn(id=f"{session.id}-{ordinal}", session_id=session.id, ordinal=ordinal,
                                    prompt="p", state="finished", stop_reason="end_turn",
                                    started_at=now - timedelta(minutes=4 - ordinal), ended_at=now))
                    db.add(ExecutorRunning(session_id=session.id, task_id=task.id, instance_id=f"i-{session.id}",
                                           endpoint="/nonexistent.sock", workspace_path="/nonexistent",
                                           agent_profile="mock", status="live", created_by_boot="bench"))
    finally:
        store.close()


def board_seconds(socket: Path) -> float:
    t0 = time.perf_counter()
    result = call(socket, "task_list")
    elapsed = time.perf_counter() - t0
    assert result["tasks"], "an empty board"
    return elapsed


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    bindir = server_bin()
    if bindir is None:
        print("NOT MEASURED: ratio cluster board / local board (no PostgreSQL server installed)")
        return 0
    pg = PgCluster(bindir).start()
    workdir = Path(tempfile.mkdtemp(prefix="kd-bench-cluster-", dir="/var/tmp"))
    homes: list[tuple[Path, dict[str, str]]] = []
    try:
        local_url, cluster_url = pg.new_database(), pg.new_database()
        local = home_of(workdir, "local", local_url, None)
        cluster = [home_of(workdir, name, cluster_url, name) for name in ("a", "b", "c")]
        for home, env in (local, *cluster):
            kandev(home, env, "up")
            homes.append((home, env))
        fill(local_url, [None] * 3, n)
        fill(cluster_url, ["a", "b", "c"], n)
        local_sock, cluster_sock = local[0] / "run" / "backend.sock", cluster[0][0] / "run" / "backend.sock"
        for sock in (local_sock, cluster_sock):  # one look each before measuring (caches, plans)
            board_seconds(sock)
        local_s, cluster_s = [], []
        for _ in range(ROUNDS):
            local_s.append(board_seconds(local_sock))
            cluster_s.append(board_seconds(cluster_sock))
        rows = len(call(cluster_sock, "task_list")["tasks"])
        ratio = min(cluster_s) / min(local_s)
        print(f"cluster board: 3 hosts x {n} sessions ({rows} tasks) on host a: best {min(cluster_s) * 1000:.1f} ms"
              f" of {ROUNDS}")
        print(f"local board: 1 host x {3 * n} sessions: best {min(local_s) * 1000:.1f} ms of {ROUNDS}"
              " (the baseline, same run, same PostgreSQL)")
        print(f"ratio cluster board / local board: {ratio:.2f} (goal <= {GOAL}; sessions written into the stores,"
              " no agents started)")
        print("PASS" if ratio <= GOAL else "FAIL: ratio cluster board / local board above its goal")
        return 0
    finally:
        for home, env in homes:
            subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "down"], env=env,
                           capture_output=True, timeout=120)
        pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
