"""Benchmark: re-tracking N surviving sessions, from first contact to the last publication.

Run: ``python tests/bench/bench_recovery.py [N]`` (default 1000; targets: ratio <= 20 at N=1000,
< 5 s and a backend RSS < 300 MB at N=10000). Where this machine cannot hold N agents (open
files, pids) it says why and runs the largest N that fits instead, labelled as such.

Set-up: a real backend and control server (survival on, no service manager);
the backend is SIGKILLed; N instances are created on the surviving control
server with a minimal real ACP agent (a shell loop answering ``initialize``
and ``session/new``: the mock agent is a Python process of ~40 MB, a thousand
of them do not fit a 2-core test machine), and N tasks, sessions and
inventory rows are written to the store as a backend would have left them (each agent between
turns: the session waiting for input, its task in review).
Then a new backend starts; its ``kandev status`` reports the recovery duration
measured from the first contact with the recorded endpoint. That backend is SIGKILLed and another
started, ``RESTARTS`` times in all over the same agents: one recovery is a single fraction of a
second on a machine whose speed drifts, so the figure is the median (each run is printed).

Baseline, measured in the same run: one enumeration (``list_instances``) of
those N instances by a client, i.e. the cheapest possible look at them (the best of five).

Also printed: the whole restart as an operator sees it, ``kandev up`` until the backend is ready,
next to the same restart with no agent to re-track (measured first, against the same surviving
control server; goal: about a second at N=1000); the control server's memory per idle instance
(its RSS growth over the N instances / N; target <= 128 KiB); and the new backend's RSS once it
re-tracked them all.
Above ``SANDBOX_MAX`` instances the agents run unsandboxed (``sandbox.policy = off``): a
bubblewrap sandbox is two more processes per agent, and 10,000 of them exceed a small machine's
pid limit; recovery never touches the agents' processes, so the figure is the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.agentctl import launch as launch_file  # noqa: E402
from daemon.agentctl.client.connection import AgentctlClient  # noqa: E402
from daemon.store.db import Store, sqlite_url  # noqa: E402
from daemon.store.models import ControlServerRecord, ExecutorRunning, Task, TaskSession  # noqa: E402

TARGET_RATIO = 20.0
TARGET_S_10K = 5.0
TARGET_RSS_MB_10K = 300
TARGET_KIB_PER_INSTANCE = 128
SANDBOX_MAX = 2000
RESTARTS = 3  # backends killed and started again over the same N agents; the figures are medians
MINIMAL_AGENT = r"""
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n 's/.*"id": *\([0-9][0-9]*\).*/\1/p')
  case "$line" in
    *'"initialize"'*) printf '{"jsonrpc":"2.0","id":%s,"result":{"protocolVersion":1,"agentCapabilities":{}}}\n' "$id" ;;
    *'"session/new"'*) printf '{"jsonrpc":"2.0","id":%s,"result":{"sessionId":"bench-%s"}}\n' "$id" "$$" ;;
    *) [ -n "$id" ] && printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32601,"message":"not supported"}}\n' "$id" ;;
  esac
done
"""


def kandev(home: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
        capture_output=True, text=True, env=env, timeout=900, check=True,
    )
    return json.loads(out.stdout)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """A process's resident set (or its peak, ``VmHWM``) in KiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def kill_and_wait(pid: int) -> None:
    """SIGKILL a backend we started and return once it is gone (woken by its exit, a pidfd)."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [], 30)
    finally:
        os.close(fd)


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def connect_as_backend(home: Path) -> tuple[AgentctlClient, str]:
    """A client of the control server with the credential the last backend stored (it rotates at
    every adoption), and the server's endpoint."""
    store = Store.open(sqlite_url(home / "kandev.db"))
    with store.session() as db:
        rec = db.get(ControlServerRecord, 1)
        endpoint, ref = rec.endpoint, rec.credential_ref
    store.close()
    credential = launch_file.read_credential_file(home / "secrets" / ref)
    installation = (home / "installation-id").read_text().strip()
    return await AgentctlClient.connect(endpoint, credential=credential, installation_id=installation), endpoint


async def wait_all_attached(home: Path, n: int, timeout: float = 120.0) -> None:
    """Return once the control server counts all ``n`` instances attached (the new backend's event
    consumers have their streams)."""
    client, _ = await connect_as_backend(home)
    try:
        deadline = time.monotonic() + timeout
        while sum(1 for i in await client.list_instances() if i["attached"]) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every one of {n} instances attached within {timeout} s")
            await asyncio.sleep(0.01)
    finally:
        await client.close()


async def create_instances(home: Path, n: int, workspace: Path) -> tuple[list[dict[str, Any]], float]:
    client, endpoint = await connect_as_backend(home)
    made: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(32)
    sandbox = {"policy": "required" if n <= SANDBOX_MAX else "off"}

    async def one(i: int) -> None:
        session_id, task_id = uuid.uuid4().hex, uuid.uuid4().hex
        async with sem:
            info = await client.create_instance(
                session_id=session_id, task_id=task_id, command=["sh", "-c", MINIMAL_AGENT], cwd=str(workspace),
                sandbox=sandbox,
            )
        made.append({**info, "session_id": session_id, "task_id": task_id})

    await asyncio.gather(*(one(i) for i in range(n)))
    enumeration = float("inf")
    for _ in range(5):  # the best of five: the server may still be settling its last launches
        t0 = time.perf_counter()
        listed = await client.list_instances()
        enumeration = min(enumeration, time.perf_counter() - t0)
        assert len(listed) == n
    await client.close()
    store = Store.open(sqlite_url(home / "kandev.db"))
    with store.session() as db:
        for m in made:
            # an agent between turns, as a backend leaves it: the session waits for input, its
            # task is in review (a RUNNING session always has an open turn row; one without is the
            # crash window that re-tracking repairs, tests/integration/test_retracking.py)
            db.add(Task(id=m["task_id"], title="bench", workspace=str(workspace), executor="local",
                        state="review"))
            db.flush()
            db.add(TaskSession(id=m["session_id"], task_id=m["task_id"], agent="mock", state="WAITING_FOR_INPUT",
                               metadata_json={"acp": {"session_id": m["acp_session_id"]}}, passthrough=False))
            db.flush()
            db.add(ExecutorRunning(
                session_id=m["session_id"], task_id=m["task_id"], instance_id=m["instance_id"], endpoint=endpoint,
                agent_pid=m["pid"], agent_pid_start_time=m["pid_start_time"],
                agent_pid_start_stamp=m.get("pid_start_stamp"), resume_token=m["acp_session_id"],
                workspace_path=str(workspace), runtime="standalone", agent_profile="mock", status="live",
                last_event_seq=0, created_by_boot="bench", metadata_json={},
            ))
    store.close()
    return made, enumeration


# Open files per surviving agent, measured ("open files once streaming"): the control server's ends
# of the agent's three pipes and its pidfd (stderr files are open only while written; the
# re-tracking backend's event streams share one connection).
FDS_PER_INSTANCE = 4


def _processes(n: int) -> int:
    """Processes ``n`` agents run as: bwrap, its sandbox's init and the agent up to ``SANDBOX_MAX``
    (the sandbox is off above it)."""
    return 3 * n if n <= SANDBOX_MAX else n


def room_for(n: int) -> str | None:
    """Why this machine cannot hold ``n`` surviving agents, or None if it can."""
    hard, pid_max = _limits()
    if hard is not None and FDS_PER_INSTANCE * n + 1024 > hard:
        return (f"the control server needs ~{FDS_PER_INSTANCE * n + 1024} open files for {n} agents;"
                f" the open-file hard limit here is {hard}")
    if _processes(n) + 2048 > pid_max:
        return f"{_processes(n)} agent processes do not fit kernel.pid_max={pid_max}"
    return None


def _limits() -> tuple[int | None, int]:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return (None if hard == resource.RLIM_INFINITY else hard), pid_max


def largest_that_fits() -> int:
    """The largest N (a multiple of 100) that ``room_for`` admits here."""
    hard, pid_max = _limits()
    n = max(SANDBOX_MAX, pid_max - 2048)
    if hard is not None:
        n = min(n, (hard - 1024) // FDS_PER_INSTANCE)
    return n // 100 * 100


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    why = room_for(n)
    if why is None:
        return measure(n, n)
    print(f"re-tracking N={n} surviving sessions: SKIPPED: {why}")
    fits = largest_that_fits()
    if fits < 1000:
        return 0
    # The largest run this machine holds instead, labelled as such (its targets are N=1000's):
    # how time and memory grow on the way to N, not a measurement of N.
    print(f"  instead, the largest N that fits here (not a measurement of N={n}):")
    return measure(fits, n)


def measure(n: int, wanted: int) -> int:
    """Measure re-tracking ``n`` sessions and print the figures; ``wanted`` is the N asked for (the
    targets of N=10000 apply only to a run of that size)."""
    with tempfile.TemporaryDirectory(prefix="kd-rbench-", dir="/var/tmp") as d:
        root = Path(d)
        os.chmod(root, 0o700)
        home, workspace = root / "home", root / "ws"
        workspace.mkdir()
        config = root / "kandev.toml"
        config.write_text("")
        env = dict(os.environ, PYTHONPATH=str(REPO), KANDEV_CONFIG=str(config), KANDEV_FEATURES_AGENT_SURVIVAL="true")
        st = kandev(home, env, "up")["status"]
        ctl_pid = st["control_server"]["pid"]
        try:
            kill_and_wait(st["backend"]["pid"])
            # the restart's baseline: the same restart with no agent to re-track
            t0 = time.perf_counter()
            idle = kandev(home, env, "up")
            restart_idle_s = time.perf_counter() - t0
            assert idle["started"] and idle["status"]["control_server"]["pid"] == ctl_pid, idle
            kill_and_wait(idle["status"]["backend"]["pid"])
            idle_kib, idle_fds = rss_kib(ctl_pid), open_files(ctl_pid)
            t0 = time.perf_counter()
            made, enumeration = asyncio.run(create_instances(home, n, workspace))
            created_s = time.perf_counter() - t0
            per_instance = (rss_kib(ctl_pid) - idle_kib) / n
            recoveries: list[float] = []
            restarts: list[float] = []
            streaming: list[float] = []
            retracked = n
            for r in range(RESTARTS):  # the same N sessions re-tracked by each new backend
                t0 = time.perf_counter()
                st2 = kandev(home, env, "up")["status"]
                restarts.append(time.perf_counter() - t0)
                asyncio.run(wait_all_attached(home, n))
                streaming.append(time.perf_counter() - t0)
                recoveries.append(st2["recovery"]["duration_ms"] / 1000)
                retracked = min(retracked, st2["recovery"]["retracked"])
                backend = st2["backend"]["pid"]
                rss_mb, peak_mb = rss_kib(backend) / 1024, rss_kib(backend, "VmHWM") / 1024
                ctl_fds, backend_fds = open_files(ctl_pid), open_files(backend)
                if r < RESTARTS - 1:
                    kill_and_wait(backend)
            recovery_s, restart_s = statistics.median(recoveries), statistics.median(restarts)
            ratio = recovery_s / enumeration
            print(f"re-tracking N={n} surviving sessions ({n} instances created in {created_s:.0f} s,"
                  f" sandbox {'on' if n <= SANDBOX_MAX else 'off'}; {RESTARTS} restarts, medians)")
            print(f"  baseline, one enumeration of {n} instances: {enumeration * 1000:8.1f} ms")
            print(f"  recovery, first contact to last publication: {recovery_s * 1000:8.1f} ms"
                  f"  ({' / '.join(f'{x * 1000:.0f}' for x in recoveries)} ms;"
                  f" {retracked} re-tracked each time, {st2['recovery']['not_retracked']} not)")
            print(f"  ratio recovery / enumeration: {ratio:.1f}")
            print(f"  restart seconds with {n} surviving agents (kandev up, to ready): {restart_s:.2f}"
                  f" (with none: {restart_idle_s:.2f}; ratio {restart_s / restart_idle_s:.2f})")
            print(f"  restart seconds to every event stream attached: {statistics.median(streaming):.2f}")
            print(f"  backend RSS after re-tracking: {rss_mb:.0f} MB (peak {peak_mb:.0f} MB)")
            print(f"  open files once streaming: backend {backend_fds}, control server {ctl_fds}"
                  f" ({(ctl_fds - idle_fds) / n:.2f} per agent)")
            print(f"  control-server memory per idle instance: {per_instance:.0f} KiB"
                  f" (server RSS {idle_kib / 1024:.0f} MB before the {n} instances;"
                  f" target <= {TARGET_KIB_PER_INSTANCE} KiB: {'PASS' if per_instance <= TARGET_KIB_PER_INSTANCE else 'FAIL'})")
            if n >= 10_000:
                ok = retracked == n and recovery_s < TARGET_S_10K and peak_mb < TARGET_RSS_MB_10K
                target = f"< {TARGET_S_10K:g} s and backend RSS < {TARGET_RSS_MB_10K} MB"
            else:
                ok = retracked == n and ratio <= TARGET_RATIO
                target = f"ratio <= {TARGET_RATIO:g}"
            print(f"  target {target} with all {n} re-tracked: {'PASS' if ok else 'FAIL'}")
            if wanted != n:
                print(f"  target of N={wanted}: NOT MEASURED (this machine cannot hold {wanted} agents)")
        finally:
            subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "down"], env=env,
                           capture_output=True, timeout=120)
            try:
                os.kill(ctl_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            time.sleep(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
