"""Stopping a child control server (Issue 24 item 4): ``Launcher.terminate`` returns when the child
has exited, woken by the exit itself (a pidfd), and kills a child that outlives its grace.

The children are real processes (``sleep``, and ``sh`` ignoring SIGTERM), started here and reaped
here; nothing is timed.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess

from daemon.backend.control.launcher import ControlServerHandle, Launcher


def _handle(argv: list[str]) -> ControlServerHandle:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    return ControlServerHandle(endpoint="unused", mode="child", credential_ref="unused", log_path=None,
                               pid=proc.pid, process=proc)


def test_a_child_that_stops_on_sigterm_is_reaped_with_its_status() -> None:
    handle = _handle(["sleep", "30"])
    assert handle.process is not None
    asyncio.run(Launcher.terminate(handle, timeout=30.0))
    assert handle.process.returncode == -signal.SIGTERM  # ended by the SIGTERM, not the kill


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    # sh says "ready" once SIGTERM is ignored, then becomes a sleep that inherits the ignoring
    handle = _handle(["sh", "-c", "trap '' TERM; echo ready; exec sleep 30"])
    assert handle.process is not None and handle.process.stdout is not None
    assert handle.process.stdout.readline() == b"ready\n"
    asyncio.run(Launcher.terminate(handle, timeout=0.2))
    assert handle.process.returncode == -signal.SIGKILL
    handle.process.stdout.close()


def test_a_child_already_gone_is_left_alone() -> None:
    handle = _handle(["true"])
    assert handle.process is not None
    handle.process.wait()
    asyncio.run(Launcher.terminate(handle, timeout=30.0))
    assert handle.process.returncode == 0
