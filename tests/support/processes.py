"""Looking at and stopping processes a test started (never by name: by pid or process group)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import psutil

from daemon.host import process_start
from tests.support.waiting import wait_until


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _in_group(pgid: int) -> Iterator[tuple[int, str]]:
    """(pid, status) of each process of group ``pgid`` (one that ends meanwhile is skipped)."""
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid:
                yield proc.pid, proc.status()
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` runs (zombies do not count)."""
    return any(status != psutil.STATUS_ZOMBIE for _, status in _in_group(pgid))


def group_exists(pgid: int) -> bool:
    """Whether a process of the group still runs. A zombie does not count: a sandboxed agent's
    bwrap init is reaped by whoever inherited it (init), which may take a moment after it died."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return group_alive(pgid)


def stopped_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that are stopped (SIGSTOP or the like), by pid."""
    return sorted(pid for pid, status in _in_group(pgid) if status == psutil.STATUS_STOPPED)


def signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` was sent to process ``pid`` and not yet delivered (a stopped process keeps
    every signal but SIGKILL and SIGCONT pending); False once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return any(mask & (1 << (sig - 1)) for mask in masks)


def kill_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL, a process group this test run started; each given 5 s to go."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not group_exists(pgid), 5, message="group gone")
            return


def terminate(pid: int, group: bool = False) -> None:
    """SIGTERM then SIGKILL a pid (or the group it leads) that this test run started."""
    kill = os.killpg if group else os.kill
    try:
        kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        wait_until(lambda: not alive(pid), timeout=10)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            kill(pid, signal.SIGKILL)


def cmdline(pid: int) -> list[str]:
    """The argv of ``pid`` ([] when it is gone or unreadable)."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def start_ticks(pid: int) -> int:
    """A process's start in clock ticks since boot (``psutil.NoSuchProcess`` when none has the
    pid). Not psutil's ``create_time()``: that adds the boot time the kernel derives from the wall
    clock, so a step of the clock (NTP, a virtual machine resumed) moves it."""
    seen = process_start.read(pid)
    if seen is None:
        raise psutil.NoSuchProcess(pid)
    return seen.ticks


def identity(pid: int) -> tuple[int, int]:
    """A process's identity: its pid and start (a reused pid has another start)."""
    return pid, start_ticks(pid)
