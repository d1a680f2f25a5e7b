"""Benchmark: ipc request/response round trip against a raw AF_UNIX echo.

Run from the repository root: ``python tests/bench/bench_ipc.py [-n N]``.

In one run it measures, each server in its own subprocess (so the client
never competes with the server for the GIL):

- raw: a blocking AF_UNIX echo server, the client sends a request-sized
  byte string and reads it back (the floor any protocol pays);
- ipc sync: ``SyncClient.call("echo", ...)`` against an ``IpcServer``;
- ipc async: ``AsyncClient.call("echo", ...)``, sequential, same server;
- ipc sync, task: ``SyncClient.call("echo_task", ...)``: the same echo written as an
  ``async def`` handler, which the server runs in a task of its own (``echo`` is a plain
  function, answered inline, as the control server's non-waiting ops are). For information.

The N round trips of each variant are split into interleaved rounds (raw,
sync, async, raw, ...) so that noise from other processes hits every
variant alike. It prints microseconds per round trip for the best and the
median round, and the ratios ipc/raw, for two placements:

- one CPU: client and both servers pinned to the same CPU. This measures
  the work per round trip (CPU time and context switches) and is the
  reproducible figure: on a small VM whose other CPUs are idle, every
  cross-CPU wake-up of an epoll-based (asyncio) process can cost tens of
  microseconds of virtual-CPU wake-up latency, which doubles the asyncio
  figures when the machine is idle and not when it is busy, while the
  blocking raw echo hardly moves;
- spread: no pinning, the scheduler's choice (shown for information).

The target is ratio <= 3 for ``SyncClient`` and for ``AsyncClient`` on the
one-CPU placement, judged on best rounds (the least noisy estimate, as timeit does); the
verdict is printed as PASS/FAIL but the exit status is 0 either way (a
benchmark is a measurement, not a gate).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from ipc import AsyncClient, Op, OpTable, SyncClient  # noqa: E402
from ipc import loop as event_loop  # noqa: E402

TARGET_RATIO = 3.0
PAYLOAD = {"x": 12345, "s": "hello world"}
TABLE = OpTable("bench", (1, 0), [
    Op("echo", optional={"x": int, "s": str}, auth=False),
    Op("echo_task", optional={"x": int, "s": str}, auth=False),
])


# -- servers (run in a subprocess) ---------------------------------------------


def run_raw_server(path: str) -> None:
    """Blocking echo: one connection at a time, echo whatever arrives."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    break
                conn.sendall(data)


def run_ipc_server(path: str) -> None:
    from ipc import IpcServer

    def echo(ctx: object, args: dict) -> dict:
        return args

    async def echo_task(ctx: object, args: dict) -> dict:
        return args

    async def main() -> None:
        server = IpcServer(path, TABLE, {"echo": echo, "echo_task": echo_task})
        await server.start()
        await asyncio.Event().wait()

    event_loop.run(main())  # the loop the backend serves its socket on


# -- client side ---------------------------------------------------------------


def wait_for_socket(path: str, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with status {proc.returncode}")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            return
        except OSError:
            time.sleep(0.02)
        finally:
            probe.close()
    raise TimeoutError(f"no server on {path} after {timeout} s")


def start_server(kind: str, path: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, __file__, f"--{kind}-server", path])
    wait_for_socket(path, proc)
    return proc


class RawClient:
    """Blocking AF_UNIX echo client sending request-sized byte strings."""

    def __init__(self, path: str) -> None:
        from ipc import encode_frame

        self.request = encode_frame({"v": 1, "id": 1, "op": "echo", "args": PAYLOAD})
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buf = bytearray(65536)

    def run(self, n: int) -> float:
        sock, request, buf, size = self.sock, self.request, self.buf, len(self.request)
        start = time.perf_counter()
        for _ in range(n):
            sock.sendall(request)
            got = 0
            while got < size:
                got += sock.recv_into(buf)
        return (time.perf_counter() - start) / n * 1e6

    def close(self) -> None:
        self.sock.close()


class SyncBench:
    def __init__(self, path: str, op: str = "echo") -> None:
        self.client = SyncClient(path)
        self.op = op
        assert self.client.call(op, PAYLOAD) == PAYLOAD

    def run(self, n: int) -> float:
        call, op = self.client.call, self.op
        start = time.perf_counter()
        for _ in range(n):
            call(op, PAYLOAD)
        return (time.perf_counter() - start) / n * 1e6

    def close(self) -> None:
        self.client.close()


class AsyncBench:
    def __init__(self, path: str) -> None:
        self.loop = event_loop.new_event_loop()
        self.client = self.loop.run_until_complete(AsyncClient.connect(path))

    async def _run(self, n: int) -> float:
        call = self.client.call
        start = time.perf_counter()
        for _ in range(n):
            await call("echo", PAYLOAD)
        return (time.perf_counter() - start) / n * 1e6

    def run(self, n: int) -> float:
        return self.loop.run_until_complete(self._run(n))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20000, help="round trips per measurement")
    parser.add_argument(
        "--rounds", type=int, default=10, help="interleaved rounds the N round trips are split in"
    )
    parser.add_argument("--raw-server", metavar="PATH", help=argparse.SUPPRESS)
    parser.add_argument("--ipc-server", metavar="PATH", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.raw_server:
        run_raw_server(opts.raw_server)
        return 0
    if opts.ipc_server:
        run_ipc_server(opts.ipc_server)
        return 0

    labels = {
        "raw": "raw AF_UNIX echo (blocking)",
        "sync": "ipc SyncClient  -> IpcServer",
        "async": "ipc AsyncClient -> IpcServer",
        "sync_task": "ipc SyncClient, async handler",
    }
    all_cpus = sorted(os.sched_getaffinity(0))
    configs = [("one CPU (client and servers pinned together)", {all_cpus[0]})]
    if len(all_cpus) > 1:
        configs.append((f"spread over {len(all_cpus)} CPUs (unpinned)", set(all_cpus)))
    per_round = max(1, opts.n // opts.rounds)
    loop = event_loop.new_event_loop()
    print(
        f"{per_round * opts.rounds} round trips per variant in {opts.rounds} interleaved rounds; "
        f"us per round trip: best round / median round; event loop: {event_loop.loop_name(loop)}"
    )
    loop.close()
    verdict_ratio = None
    for title, cpus in configs:
        os.sched_setaffinity(0, cpus)  # the servers started below inherit it
        try:
            rounds = measure(per_round, opts.rounds)
        finally:
            os.sched_setaffinity(0, all_cpus)
        best = {name: min(values) for name, values in rounds.items()}
        median = {name: statistics.median(values) for name, values in rounds.items()}
        print(f"-- {title}")
        for name, label in labels.items():
            line = f"{label:30}: {best[name]:7.1f} / {median[name]:7.1f} us"
            if name != "raw":
                line += f"   ratio {best[name] / best['raw']:.2f} / {median[name] / median['raw']:.2f}"
            print(line)
        if verdict_ratio is None:
            verdict_ratio = max(best["sync"], best["async"]) / best["raw"]
    assert verdict_ratio is not None
    verdict = "PASS" if verdict_ratio <= TARGET_RATIO else "FAIL"
    print(
        f"{verdict}: SyncClient and AsyncClient / raw: ratio at most {verdict_ratio:.2f} on best rounds,"
        f" one CPU (target <= {TARGET_RATIO:g} for both)"
    )
    return 0


def measure(per_round: int, rounds_count: int) -> dict[str, list[float]]:
    """Start both servers, run the interleaved rounds, stop the servers."""
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as tmp:
        os.chmod(tmp, 0o700)
        raw_path, ipc_path = os.path.join(tmp, "raw.sock"), os.path.join(tmp, "ipc.sock")
        procs = [start_server("raw", raw_path), start_server("ipc", ipc_path)]
        try:
            benches = {"raw": RawClient(raw_path), "sync": SyncBench(ipc_path), "async": AsyncBench(ipc_path),
                       "sync_task": SyncBench(ipc_path, "echo_task")}
            for bench in benches.values():  # warm up
                bench.run(max(1, per_round // 4))
            rounds: dict[str, list[float]] = {name: [] for name in benches}
            for _ in range(rounds_count):  # interleaved, so machine noise hits every variant alike
                for name, bench in benches.items():
                    rounds[name].append(bench.run(per_round))
            for bench in benches.values():
                bench.close()
            return rounds
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
