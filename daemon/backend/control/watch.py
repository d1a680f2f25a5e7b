"""Is the control server this backend uses still running, and if not, why did it go?

A ``ServerWatch`` is bound to one started or adopted server (its ``ControlServerHandle``). Its
``gone()`` is cheap enough to call twice a second and never blocks the event loop:

- our child (``child`` mode, or a ``detached`` server this backend spawned): ``Popen.poll()``,
  which also reaps it and gives the exit status;
- otherwise (an adopted detached server, or the ``kandev-agentctl.service`` main process): the
  process identity, pid plus start, so a reused pid is never taken for the server. The start is
  compared in clock ticks since boot (``daemon.host.process_start``), which a step of the wall clock
  cannot move; a wall-clock start time recorded at launch is checked once, when the watch begins;
- no pid known at all: only the connection can tell; it is gone when the backend's connection
  has dropped and nothing listens at the endpoint any more (the socket file is gone or refuses
  connections). A server that accepts but does not answer yet is alive: that is what a server
  re-executing in place looks like (Issue 15: its listening socket stays open across the exec).

A reload (re-exec in place) is never a loss: the process keeps its pid and its start time, and a
child keeps running.

``reason()`` says why, as precisely as can be known: the exit status or signal of a child; for
the unit, what systemd recorded (``ExecMainCode``/``ExecMainStatus``/``Result``, read with an
asynchronous ``systemctl show``); for a process that is not our child, that the status is unknown.
A server that is alive but does not answer is not gone: its connection problems are retried by
whoever uses it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
from collections.abc import Callable

import psutil

from daemon.backend.control.launcher import AGENTCTL_UNIT, ControlServerHandle
from daemon.host import process_start
from daemon.store.states import LaunchMode
from ipc.aio import within

SYSTEMCTL_TIMEOUT_S = 10.0
UNIT_SETTLE_S = 2.0  # how long reason() waits for systemd to record the main process's end
NOT_THE_SERVER = -1  # start ticks of a watch whose pid was not the server's when it began (ticks are >= 0)
_CLD = {"1": "exited", "2": "killed", "3": "dumped"}  # ExecMainCode: CLD_EXITED, CLD_KILLED, CLD_DUMPED


def describe_status(returncode: int) -> str:
    """A Popen return code in words: ``exited with status 3`` / ``killed by signal SIGKILL``."""
    if returncode < 0:
        return f"killed by signal {_signal_name(-returncode)}"
    return f"exited with status {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ServerWatch:
    """Watches one control server (see the module docstring)."""

    def __init__(self, handle: ControlServerHandle, client_closed: Callable[[], bool] = lambda: False) -> None:
        self.handle = handle
        self.client_closed = client_closed
        # The server's start in ticks since boot, read now (None: it could not be read; NOT_THE_SERVER:
        # the pid was gone, or another process holds it).
        self.start_ticks: int | None = None
        if handle.pid and handle.process is None:
            self.start_ticks = _first_look(handle.pid, handle.pid_start_time)

    async def gone(self) -> bool:
        proc = self.handle.process
        if proc is not None:
            return proc.poll() is not None
        pid = self.handle.pid
        if pid:
            return not _same_process(pid, self.start_ticks)
        if not self.client_closed():
            return False
        return not _listening(self.handle.endpoint)

    async def reason(self) -> str:
        proc = self.handle.process
        if proc is not None and proc.returncode is not None:
            return describe_status(proc.returncode)
        if self.handle.mode == LaunchMode.UNIT:
            return await _unit_reason()
        if self.handle.pid:
            return f"process {self.handle.pid} is gone; its exit status is unknown (not a child of this backend)"
        return "its connection dropped and nothing answers at its endpoint; exit status unknown"


def _listening(endpoint: str) -> bool:
    """Whether something listens on the Unix socket ``endpoint``: a non-blocking connect, which
    never waits (a full accept queue answers EAGAIN: alive). Nothing is sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(endpoint)
    except BlockingIOError:
        return True  # its accept queue is full: very much alive
    except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # cannot tell (e.g. permission): not proof that it is gone
    finally:
        sock.close()
    return True


def _first_look(pid: int, start_time: float | None) -> int | None:
    """The start ticks of the process ``pid`` names now: a launched server's own start (``start_time``,
    wall-clock, read right after its launch) if given, else (adopted: it just answered with our
    credential) whatever holds the pid. ``NOT_THE_SERVER`` if that is not the server; None if it
    cannot be read."""
    try:
        seen = process_start.read(pid)
        if seen is None or seen.exited:
            return NOT_THE_SERVER
        if start_time is not None and abs(psutil.Process(pid).create_time() - start_time) > 0.01:
            return NOT_THE_SERVER  # the pid was reused by another process
        return seen.ticks
    except psutil.NoSuchProcess:
        return NOT_THE_SERVER
    except (OSError, psutil.Error):
        return None  # cannot tell (e.g. permission): watched by the pid alone


def _same_process(pid: int, start_ticks: int | None) -> bool:
    if start_ticks == NOT_THE_SERVER:
        return False
    try:
        seen = process_start.read(pid)
    except OSError:
        return True  # cannot tell (e.g. permission): not proof that it is gone
    if seen is None or seen.exited:
        return False
    return start_ticks is None or seen.ticks == start_ticks


async def _systemctl_show(*props: str) -> dict[str, str]:
    proc = await asyncio.create_subprocess_exec(
        "systemctl", "show", "-p", ",".join(props), AGENTCTL_UNIT,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        out, _ = await within(proc.communicate(), SYSTEMCTL_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {}
    return dict(line.split("=", 1) for line in out.decode(errors="replace").splitlines() if "=" in line)


async def _unit_reason() -> str:
    """What systemd recorded about the unit's main process, once it has recorded it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + UNIT_SETTLE_S
    props: dict[str, str] = {}
    while True:
        props = await _systemctl_show("ActiveState", "Result", "ExecMainCode", "ExecMainStatus")
        if props.get("ActiveState") not in ("active", "reloading") or loop.time() >= deadline:
            break
        await asyncio.sleep(0.1)
    code, status = props.get("ExecMainCode", ""), props.get("ExecMainStatus", "")
    state = f"{AGENTCTL_UNIT} is {props.get('ActiveState', 'unknown')} (result {props.get('Result', 'unknown')})"
    how = _CLD.get(code)
    if how == "exited":
        return f"exited with status {status}; {state}"
    if how in ("killed", "dumped") and status.isdigit():
        return f"killed by signal {_signal_name(int(status))}{' (core dumped)' if how == 'dumped' else ''}; {state}"
    return f"its main process is gone; {state}"
