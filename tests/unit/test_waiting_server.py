"""daemon.backend.lifetime.waiting_server: the CLI socket while the backend waits to open its store
(a full disk, Issue 21 item 5; an unreachable database server, Issue 47 item 5)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from daemon.backend.lifetime.cli_listener import CliListener
from daemon.backend.lifetime.waiting_server import serve_while
from daemon.core.service import Notifier
from daemon.host.paths import Paths
from ipc.errors import IpcError
from tests.support.aio import run


class RecordingNotifier(Notifier):
    """What the waiting server tells systemd, kept instead of sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, ...]] = []

    def notify(self, *fields: str) -> None:
        self.sent.append(fields)

    @property
    def pings(self) -> int:
        return sum("WATCHDOG=1" in fields for fields in self.sent)


def _status() -> dict[str, Any]:
    return {"backend": {"state": "waiting"}}


def _refusal() -> IpcError:
    return IpcError("store_unreachable", "waiting", True)


def test_the_watchdog_is_fed_while_waiting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 47 item 5, Issue 21 item 5: the unit's ``WatchdogSec=`` holds while the backend waits
    (it said READY=1): a wait longer than it must not read as a hung backend, so the waiting server
    pings; once the wait is over the listener is handed on, not closed."""
    import os

    monkeypatch.setenv("WATCHDOG_USEC", "20000")  # a ping every 10 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    notifier = RecordingNotifier()
    listener = CliListener()

    async def until() -> None:
        while notifier.pings < 3:
            await asyncio.sleep(0.01)

    try:
        stopped = run(serve_while(paths, [], notifier, listener, status=_status, refusal=_refusal,
                                  why="waiting for it", until=until), timeout=30)
        assert stopped is False and listener.held and paths.backend_socket.exists()
        assert ("READY=1", "STATUS=waiting for it") in notifier.sent
    finally:
        listener.release()


def test_a_failed_wait_closes_the_socket_and_says_why(tmp_path: Path) -> None:
    """Issue 47 item 5: an attempt that fails for another reason than the wait's (another backend
    took the store's lock meanwhile) ends the wait with that error, the socket closed."""
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    listener = CliListener()

    async def until() -> None:
        raise RuntimeError("another backend holds the store")

    with pytest.raises(RuntimeError, match="another backend"):
        run(serve_while(paths, [], RecordingNotifier(), listener, status=_status, refusal=_refusal,
                        why="waiting", until=until), timeout=30)
    assert not listener.held and not paths.backend_socket.exists()
