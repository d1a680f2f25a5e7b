"""The daemon skeleton both mains share (daemon/core/service.py): sd_notify messages read back from a real
datagram socket, the watchdog interval, the watchdog pings, the exit codes the units rely on."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.core.service import ExitCode, Notifier, install_signal_handlers, watchdog_interval, watched


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A bound datagram socket standing where systemd's notify socket would be."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def _received(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.setblocking(True)


def test_exit_codes_keep_the_values_units_and_tests_rely_on() -> None:
    assert (ExitCode.OK, ExitCode.FAILED, ExitCode.REFUSED) == (0, 1, 2)


def test_notifier_sends_one_datagram_per_call_and_repeats_no_status(notify_socket) -> None:
    _, sock = notify_socket
    n = Notifier()
    n.status("recovering")
    n.ready("serving 0 instances")
    n.status("serving 0 instances")  # unchanged: not sent again
    n.status("serving 1 instance")
    n.extend_timeout(1.5)
    n.watchdog()
    n.stopping()
    n.reloading()
    got = _received(sock)
    assert got[:6] == [
        "STATUS=recovering",
        "READY=1\nSTATUS=serving 0 instances",
        "STATUS=serving 1 instance",
        "EXTEND_TIMEOUT_USEC=1500000",
        "WATCHDOG=1",
        "STOPPING=1",
    ]
    reloading, monotonic = got[6].split("\n")
    assert reloading == "RELOADING=1" and monotonic.startswith("MONOTONIC_USEC=")
    assert int(monotonic.split("=")[1]) > 0
    assert len(got) == 7


def test_notifier_without_notify_socket_is_silent(notify_socket, monkeypatch) -> None:
    _, sock = notify_socket
    monkeypatch.delenv("NOTIFY_SOCKET")
    n = Notifier()
    n.ready("x")
    n.stopping()
    assert _received(sock) == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 1.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected


def test_watched_pings_while_the_block_runs_and_stops_after(notify_socket, monkeypatch) -> None:
    _, sock = notify_socket
    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    n = Notifier()

    async def main() -> None:
        async with watched(n):
            for _ in range(3):
                await asyncio.to_thread(sock.recv, 64)  # blocks until a ping arrives
        await asyncio.sleep(0.05)  # five ping periods after the block: a window in which none may come

    asyncio.run(main())
    _received(sock)  # pings sent before the block ended
    assert _received(sock) == []  # none after


def test_stop_and_hangup_signals_reach_their_actions() -> None:
    async def main() -> tuple[bool, int]:
        stop = asyncio.Event()
        hangups: list[int] = []
        install_signal_handlers(asyncio.get_running_loop(), stop=stop.set, hangup=lambda: hangups.append(1))
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(stop.wait(), 5)
            return stop.is_set(), len(hangups)
        finally:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)

    assert asyncio.run(main()) == (True, 1)


def test_prepare_process_reopens_closed_std_fds_and_survives_a_hangup(tmp_path: Path) -> None:
    """A daemon started with fd 1 closed gets /dev/null there, and a SIGHUP before its event loop
    runs does not kill it."""
    script = (
        "import os, signal, sys\n"
        "from daemon.core.service import prepare_process\n"
        "prepare_process()\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "print(os.readlink('/proc/self/fd/1'), oct(os.umask(0)), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          close_fds=True, pass_fds=(), timeout=60, text=True,
                          preexec_fn=lambda: os.close(1), cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.split() == ["/dev/null", "0o77"]
