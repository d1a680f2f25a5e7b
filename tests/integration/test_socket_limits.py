"""Both daemons' sockets hold under admitted peers' misbehaviour (Issue 10 item 7): real daemons.

Against the backend's CLI socket and the control server's socket at once: 300 connections that
send nothing, and 100 that each declare an 8 MiB frame and send 64 KiB of it. Each daemon's
peak RSS (``VmHWM``, reset through ``/proc/PID/clear_refs`` just before) grows by less than
64 MiB, the real CLI keeps answering (``kandev status`` reaches both daemons), the half-sent
frames are refused once the frame timeout passes, and the idle connections are told
``idle_timeout`` and closed after ``IDLE_CONNECTION_TIMEOUT_S``.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from pathlib import Path

import pytest

from daemon.core.limits import IDLE_CONNECTION_TIMEOUT_S, raise_open_file_limit
from ipc.codec_msgpack import read_frame_sync
from ipc.framing import MAX_FRAME, ConnectionClosed

pytestmark = pytest.mark.timeout(180)

IDLE, PARTIAL = 300, 100
SENT = 64 * 1024
RSS_BOUND = 64 * 1024 * 1024


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def _reset_peak(pid: int) -> int:
    """Reset the peak-RSS mark of ``pid`` (``clear_refs`` 5) and return its RSS now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _kib(pid, "VmRSS")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)  # blocking: waits while the server's accept queue is full
    s.settimeout(10)
    return s


def _refusals(socks: list[socket.socket], deadline: float) -> dict[str, int]:
    """Read, on every socket, the server's one error frame and then EOF; count them by code."""
    codes: dict[str, int] = {}
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        frame = read_frame_sync(s)
        assert frame is not None and frame["ok"] is False and frame["id"] is None, frame
        code = frame["error"]["code"]
        codes[code] = codes.get(code, 0) + 1
        try:
            assert s.recv(1) == b""  # and then the server closed it
        except ConnectionResetError:
            pass
    return codes


def _unanswered(socks: list[socket.socket]) -> int:
    """How many of ``socks`` have nothing to read yet (no refusal, no EOF)."""
    ready, _, _ = select.select(socks, [], [], 0)
    return len(socks) - len(ready)


def test_scenario_e_idle_and_half_sent_connections_on_both_daemons(kandev_factory):
    """Issue 10 scenario E: 300 idle connections plus 100 that each declare an 8 MiB frame and send
    64 KiB, on each daemon: RSS grows by less than 64 MiB, the CLI keeps answering, idle ones are
    closed."""
    raise_open_file_limit()  # this test holds 800 sockets
    k = kandev_factory()
    st = k.up()
    daemons = {"backend": (st["backend"]["pid"], st["backend"]["socket"]),
               "control server": (st["control_server"]["pid"], st["control_server"]["endpoint"])}
    baseline = {name: _reset_peak(pid) for name, (pid, _) in daemons.items()}

    idle: list[socket.socket] = []
    partial: list[socket.socket] = []
    try:
        opened = time.monotonic()
        for _, path in daemons.values():
            idle += [_connect(path) for _ in range(IDLE)]
        last_idle = time.monotonic()
        for _, path in daemons.values():
            for _ in range(PARTIAL):
                s = _connect(path)
                s.sendall(struct.pack(">I", MAX_FRAME) + b"\x80" * SENT)
                partial.append(s)

        # While all of them are open, the real CLI reaches both daemons.
        status = k.cli("status", timeout=30)
        assert status["backend"]["state"] == "ready" and status["control_server"]["state"] == "running"
        assert _unanswered(idle) == len(idle)  # nobody was turned away for the load

        # Each half-sent frame is refused once the frame timeout passed: the server read all of it.
        codes = _refusals(partial, time.monotonic() + 30)
        assert codes == {"invalid_frame": 2 * PARTIAL}, codes
        for name, (pid, _) in daemons.items():
            growth = _kib(pid, "VmHWM") - baseline[name]
            print(f"\n{name}: peak RSS grew by {growth / 2**20:.1f} MiB")
            assert growth < RSS_BOUND, (name, growth)

        # The idle ones: not closed before the idle timeout, then told idle_timeout and closed.
        if time.monotonic() < last_idle + IDLE_CONNECTION_TIMEOUT_S - 1:
            assert _unanswered(idle) == len(idle)
        codes = _refusals(idle, last_idle + IDLE_CONNECTION_TIMEOUT_S + 30)
        assert codes == {"idle_timeout": 2 * IDLE}, codes
        assert time.monotonic() >= opened + IDLE_CONNECTION_TIMEOUT_S
        assert k.cli("status")["backend"]["state"] == "ready"
    except ConnectionClosed as exc:
        raise AssertionError(f"a connection was dropped without its refusal: {exc}") from None
    finally:
        for s in idle + partial:
            s.close()
