"""Benchmark: an agent's egress path (relay + proxy) against a direct connection (Issue 44 item 9,
Issue 44 scenario G).

Run from the repository root: ``python tests/bench/bench_proxy.py [--rounds R] [--connects N]``.

In one run, each party in a process of its own (so no two compete for one interpreter):

- a loopback HTTP server started by the benchmark (``GET /bytes/N`` answers N bytes with
  ``sendfile`` from memory, so the server costs next to nothing);
- the egress proxy exactly as the control server runs it (``daemon.agentctl.egress.listener.
  SessionEgress`` on an asyncio loop, its Unix socket, the policy with the server listed in
  ``host_ports``, as a local model server is);
- a client inside a real agent sandbox (``daemon.agentctl.sandbox.bubblewrap.wrap_command``: its
  own network namespace, the relay in front of it, the seccomp filter, the agent user), which
  reaches the server only through its proxy port, as an agent's ``curl`` does; where no sandbox can
  be made here (not root, no bwrap, no agent user) the same relay runs on the host's loopback in
  front of the client instead, and the first line says so;
- a second client on the host, the same code, connecting to the server directly: the baseline.

It prints, each figure next to its baseline of the same run:

- ``ratio proxy / direct throughput``: 100 MiB fetched through a CONNECT tunnel (what an agent's
  HTTPS traffic takes) against the same fetch made directly, median of R rounds (each round one
  fetch each way, in alternating order); goal >= 0.8;
- ``proxy connect overhead ms``: the median time until a CONNECT tunnel is established (connect
  to the proxy port, ``CONNECT``, the ``200`` read back) minus the median time of a direct
  ``connect()`` to the same server, over N of each, interleaved in batches; goal <= 2 ms.

A benchmark is a measurement, not a gate: PASS/FAIL is printed, the exit status is 0 either way.
On a busy machine repeat the run and compare ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
SIZE = 100 * MIB
THROUGHPUT_GOAL = 0.8
OVERHEAD_GOAL_MS = 2.0
BATCH = 20  # connects of one kind in a row
READ_CHUNK = MIB


# -- the HTTP server (its own process) -------------------------------------------------------


def _serve_one(conn: socket.socket, body_fd: int) -> None:
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            data = conn.recv(4096)
            if not data:
                return
            head += data
        target = head.split(b" ", 2)[1].decode("ascii", "replace")
        size = int(target.rsplit("/", 1)[1]) if target.startswith("/bytes/") else 0
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode("ascii"))
        sent = 0
        while sent < size:
            n = os.sendfile(conn.fileno(), body_fd, sent % SIZE, min(size - sent, SIZE - sent % SIZE))
            if n == 0:
                return
            sent += n


def run_http_server() -> None:
    """Serve ``GET /bytes/N`` on 127.0.0.1 (a thread per connection); print the port."""
    body = os.memfd_create("bench-body")
    os.ftruncate(body, SIZE)
    os.pwrite(body, b"x" * SIZE, 0)
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    print(listener.getsockname()[1], flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(conn, body), daemon=True).start()


# -- the proxy (its own process, as in the control server) -----------------------------------


def run_proxy(path: str, host_port: str, uid: int | None, gid: int | None) -> None:
    """The instance's egress endpoint at ``path`` until stdin closes; prints ``ready``."""
    import asyncio

    sys.path.insert(0, str(REPO_ROOT))
    from daemon.agentctl.egress.listener import SessionEgress
    from daemon.agents.network import effective_policy

    async def main() -> None:
        policy = effective_policy("allow-list", (), (host_port,), "bench")
        egress = SessionEgress("bench", "bench", "bench", policy, path)
        egress.bind(uid, gid)
        egress.start()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await egress.close()

    asyncio.run(main())


# -- the client (standard library only: it also runs inside the sandbox) ---------------------


def _tunnel(proxy: tuple[str, int], host: str, port: int) -> socket.socket:
    sock = socket.create_connection(proxy)
    sock.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode("ascii"))
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(4096)
        if not data:
            raise ConnectionError(f"the proxy closed: {answer!r:.200}")
        answer += data
    if not answer.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(f"the proxy answered {answer.splitlines()[0]!r:.200}")
    return sock


def _open(host: str, port: int, proxy: tuple[str, int] | None) -> socket.socket:
    return _tunnel(proxy, host, port) if proxy is not None else socket.create_connection((host, port))


def _fetch(host: str, port: int, size: int, proxy: tuple[str, int] | None) -> tuple[float, int]:
    """Seconds to fetch ``size`` bytes (connection included) and the bytes received (head included)."""
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with _open(host, port, proxy) as sock:
        sock.sendall(f"GET /bytes/{size} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode("ascii"))
        got = 0
        while True:
            n = sock.recv_into(view)
            if n == 0:
                break
            got += n
    return time.perf_counter() - t0, got


def _connects(host: str, port: int, n: int, proxy: tuple[str, int] | None) -> list[float]:
    """Seconds until each of ``n`` connections is usable (the tunnel established, through a proxy)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock = _open(host, port, proxy)
        out.append(time.perf_counter() - t0)
        sock.close()
    return out


def run_client() -> None:
    """Answer one JSON line per command line on stdin: ``fetch HOST PORT SIZE PROXY`` and
    ``connect HOST PORT N PROXY`` (PROXY: ``host:port`` or ``-``)."""
    for line in sys.stdin:
        verb, host, port, count, via = line.split()
        proxy = None if via == "-" else (via.rpartition(":")[0], int(via.rpartition(":")[2]))
        try:
            if verb == "fetch":
                seconds, got = _fetch(host, int(port), int(count), proxy)
                answer: object = {"seconds": seconds, "bytes": got}
            else:
                answer = {"seconds": _connects(host, int(port), int(count), proxy)}
        except OSError as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer), flush=True)


# -- the benchmark ---------------------------------------------------------------------------


class Client:
    """One client process: commands in, one JSON answer each out."""

    def __init__(self, argv: Sequence[str], proxy: str, *, own_group: bool = False, **popen: object) -> None:
        self.proxy = proxy
        self.own_group = own_group
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     process_group=0 if own_group else None, **popen)  # type: ignore[call-overload]

    def ask(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{line} {self.proxy}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the client ended (status {self.proc.wait()})")
        doc: dict[str, Any] = json.loads(answer)
        if "error" in doc:
            raise RuntimeError(f"the client failed: {doc['error']}")
        return doc

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.own_group:  # the relay on the host (a grandchild in the group) outlives its client
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sandboxed_client(work: Path, socket_path: str) -> tuple[Client | None, str]:
    """The client in a real agent sandbox behind the relay, or None and why not."""
    from daemon.agentctl.sandbox import bubblewrap, network
    from daemon.host.agent_user import AgentUserMissing
    from ipc import IpcError

    bwrap = bubblewrap.find_bwrap()
    if bwrap is None:
        return None, "no bwrap on the PATH"
    request = bubblewrap.SandboxRequest(readonly=(str(Path(__file__).resolve().parent), os.path.dirname(socket_path)))
    command = [os.path.realpath(sys.executable), "-I", "-S", str(Path(__file__).resolve()), "--client"]
    try:
        launch = bubblewrap.wrap_command(request, command, str(work), bwrap=bwrap,
                                         net=network.SandboxNet(socket_path))
    except (AgentUserMissing, IpcError, OSError, ValueError) as exc:  # IpcError: sandbox_unavailable
        return None, str(exc)
    env = network.proxy_env({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, True)
    try:
        client = Client(launch.argv, f"127.0.0.1:{network.PROXY_PORT}", pass_fds=launch.fds, env=env)
    finally:
        for fd in launch.fds:
            os.close(fd)
    return client, ""


def _host_relay_client(socket_path: str) -> Client:
    """The client behind the same relay, listening on the host's loopback (no sandbox)."""
    from daemon.agentctl.sandbox import network

    port = _free_port()
    argv = [os.path.realpath(sys.executable), "-I", "-S", network.RELAY, str(port), socket_path, "--",
            os.path.realpath(sys.executable), "-I", "-S", str(Path(__file__).resolve()), "--client"]
    return Client(argv, f"127.0.0.1:{port}", own_group=True)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ratio_line(direct: list[float], proxied: list[float]) -> str:
    d, p = SIZE / MIB / statistics.median(direct), SIZE / MIB / statistics.median(proxied)
    best = (SIZE / MIB / min(proxied)) / (SIZE / MIB / min(direct))
    verdict = "PASS" if round(p / d, 2) >= THROUGHPUT_GOAL else "FAIL"  # as printed
    return (f"ratio proxy / direct throughput: {p / d:.2f}   (proxy {p:.0f} MiB/s, direct {d:.0f} MiB/s, median of"
            f" {len(direct)} fetches of {SIZE // MIB} MiB each way; best rounds {best:.2f}; goal >= {THROUGHPUT_GOAL}:"
            f" {verdict})")


def _overhead_line(direct: list[float], proxied: list[float]) -> str:
    d, p = statistics.median(direct) * 1000, statistics.median(proxied) * 1000
    verdict = "PASS" if round(p - d, 1) <= OVERHEAD_GOAL_MS else "FAIL"  # as printed
    return (f"proxy connect overhead ms: {p - d:.1f}   (CONNECT tunnel {p:.2f} ms, direct connect {d:.2f} ms,"
            f" medians of {len(proxied)} each; goal <= {OVERHEAD_GOAL_MS:g}: {verdict})")


def bench(rounds: int, connects: int, sandbox: bool) -> None:
    from daemon.host.agent_user import AgentUserMissing, agent_user

    base = Path("/var/tmp") if os.path.isdir("/var/tmp") else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(prefix="kandev-bench-proxy-", dir=base) as tmp:
        work = Path(tmp) / "workspace"
        work.mkdir()
        os.chmod(tmp, 0o755)
        os.chmod(work, 0o755)
        socket_path = str(Path(tmp) / "egress" / "bench" / "proxy.sock")
        server = subprocess.Popen([sys.executable, __file__, "--http-server"], stdout=subprocess.PIPE, text=True)
        procs: list[subprocess.Popen[str]] = [server]
        clients: list[Client] = []
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            try:
                user = agent_user()
                ids = [str(user.uid), str(user.gid)] if user.dedicated else ["-", "-"]
            except AgentUserMissing:
                ids = ["-", "-"]
            proxy = subprocess.Popen([sys.executable, __file__, "--proxy", socket_path, f"127.0.0.1:{port}", *ids],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proxy)
            assert proxy.stdout is not None
            if proxy.stdout.readline().strip() != "ready":
                raise RuntimeError("the proxy did not start")
            via, why = _sandboxed_client(work, socket_path) if sandbox else (None, "--no-sandbox")
            if via is None:
                via = _host_relay_client(socket_path)
                print(f"proxy bench: no sandbox ({why}): the client is behind the relay on the host's loopback")
            else:
                print("proxy bench: the client runs in an agent sandbox (own network namespace, relay, seccomp),"
                      " the proxy as the control server runs it")
            clients.append(via)
            direct = Client([sys.executable, __file__, "--client"], "-")
            clients.append(direct)
            via.ask(f"fetch 127.0.0.1 {port} {MIB}")  # warm up both paths
            direct.ask(f"fetch 127.0.0.1 {port} {MIB}")
            times: dict[str, list[float]] = {"direct": [], "proxy": []}
            watched = {"server": server, "proxy": proxy, "direct client": direct.proc}
            cpu: dict[tuple[str, str], float] = dict.fromkeys(((n, k) for n in times for k in watched), 0.0)
            for r in range(rounds):
                order = [("direct", direct), ("proxy", via)]
                for name, client in order if r % 2 == 0 else reversed(order):
                    before = {k: _cpu_seconds(p.pid) for k, p in watched.items()}
                    doc = client.ask(f"fetch 127.0.0.1 {port} {SIZE}")
                    for k, p in watched.items():
                        cpu[(name, k)] += _cpu_seconds(p.pid) - before[k]
                    if not SIZE < int(doc["bytes"]) < SIZE + 4096:
                        raise RuntimeError(f"{name}: {doc['bytes']} bytes for a body of {SIZE}")
                    times[name].append(float(doc["seconds"]))
            print(_ratio_line(times["direct"], times["proxy"]))
            per = 1000 / rounds
            print(f"proxy CPU ms per {SIZE // MIB} MiB: {cpu[('proxy', 'proxy')] * per:.0f}   (for information: the"
                  f" server {cpu[('direct', 'server')] * per:.0f} and the client {cpu[('direct', 'direct client')] * per:.0f}"
                  " of a direct fetch; on a busy machine the throughput ratio follows the CPU each path needs)")
            opened: dict[str, list[float]] = {"direct": [], "proxy": []}
            done = 0
            while done < connects:
                n = min(BATCH, connects - done)
                for name, client in (("direct", direct), ("proxy", via)):
                    opened[name] += client.ask(f"connect 127.0.0.1 {port} {n}")["seconds"]
                done += n
            print(_overhead_line(opened["direct"], opened["proxy"]))
        finally:
            for c in clients:
                c.close()
            for p in procs:
                if p.stdin is not None:
                    p.stdin.close()
                if p is server:
                    p.kill()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        run_client()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--http-server":
        run_http_server()
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--proxy":
        path, host_port, uid, gid = sys.argv[2:6]
        run_proxy(path, host_port, None if uid == "-" else int(uid), None if gid == "-" else int(gid))
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=10, help="fetches of 100 MiB each way (default 10)")
    parser.add_argument("--connects", type=int, default=200, help="connections each way (default 200)")
    parser.add_argument("--no-sandbox", action="store_true", help="the relay on the host's loopback, no sandbox")
    args = parser.parse_args()
    bench(args.rounds, args.connects, not args.no_sandbox)
    return 0


if __name__ == "__main__":
    sys.exit(main())
