"""Issue 11: the probes behind a control-server loss, on real processes.

``ServerWatch`` (daemon/backend/control/watch.py) tells a dead server from a live one by its exit
status when it is our child, else by pid + start time, and says why; ``stop_leftover_group``
(daemon/backend/recovery/liveness.py) kills what is left of a lost agent's process group only when the
identity matches. Real processes, each started and stopped here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from daemon.backend.control.launcher import ControlServerHandle
from daemon.backend.control.watch import ServerWatch, describe_status
from daemon.backend.recovery.liveness import live_groups, stop_leftover_group
from daemon.backend.state.agent_identity import AgentIdentity as Agent
from daemon.host import process_start
from tests.support.processes import alive, group_alive
from tests.support.waiting import wait_until

# A group leader that starts a child in its own group, prints the child's pid, then waits.
LEADER = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def group() -> Iterator[tuple[subprocess.Popen[str], int]]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    assert leader.stdout is not None
    child = int(leader.stdout.readline())
    yield leader, child
    for pid in (leader.pid, child):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    leader.wait()


def _handle(pid: int, process: subprocess.Popen[str] | None = None, mode: str = "detached") -> ControlServerHandle:
    return ControlServerHandle(endpoint="/nonexistent/agentctl.sock", mode=mode, credential_ref="x", log_path="x",
                               pid=pid, process=process)  # type: ignore[arg-type]


def test_leftover_group_is_killed_only_when_its_identity_matches(group):
    """Issue 11 item 2: the agent is checked by pid + start time before its group is stopped."""
    leader, child = group
    start = psutil.Process(leader.pid).create_time()
    assert stop_leftover_group(Agent(leader.pid, start + 5.0)) == "gone"  # another process holds the pid now
    assert alive(leader.pid) and alive(child)  # nothing was signalled
    assert stop_leftover_group(Agent(leader.pid, None)) == "unknown"
    assert alive(leader.pid)
    assert stop_leftover_group(Agent(leader.pid, start)) == "killed"
    wait_until(lambda: not group_alive(leader.pid), timeout=10)


def test_leftover_member_of_a_dead_leader_is_killed(group):
    """The leader died with its control server; what it left in its group goes too."""
    leader, child = group
    start = psutil.Process(leader.pid).create_time()
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    assert alive(child) and leader.pid in live_groups()
    assert stop_leftover_group(Agent(leader.pid, start)) == "killed"
    wait_until(lambda: not alive(child), timeout=10)
    assert stop_leftover_group(Agent(leader.pid, start)) == "gone"


OTHER_BOOT = "00000000-0000-0000-0000-000000000000"  # a boot id that is not this boot's


def test_leftover_group_by_stamp_holds_across_a_step_of_the_wall_clock(group):
    """A recorded stamp decides, not the wall-clock start: the recorded time 16 s off (a clock step
    since) still finds the agent and kills its group; another start, or a stamp of an earlier boot
    (whose pid now names another process's group), signals nothing."""
    leader, child = group
    start = psutil.Process(leader.pid).create_time()
    stamp = process_start.stamp(leader.pid)
    assert stamp is not None
    boot, ticks = stamp.split(":")
    assert stop_leftover_group(Agent(leader.pid, start, f"{boot}:{int(ticks) + 1}")) == "gone"
    assert stop_leftover_group(Agent(leader.pid, start, f"{OTHER_BOOT}:{ticks}")) == "gone"
    os.kill(leader.pid, signal.SIGKILL)  # the leader gone, its group still has the child
    leader.wait()
    assert stop_leftover_group(Agent(leader.pid, start, f"{OTHER_BOOT}:{ticks}")) == "gone"
    assert alive(child)  # nothing was signalled
    assert stop_leftover_group(Agent(leader.pid, start - 16.0, stamp)) == "killed"
    wait_until(lambda: not alive(child), timeout=10)


def test_watch_of_a_child_server_reports_its_exit_status():
    async def run(argv: list[str], sig: int | None) -> tuple[bool, bool, str]:
        proc = subprocess.Popen(argv)
        watch = ServerWatch(_handle(proc.pid, proc, mode="child"))
        before = await watch.gone()
        if sig is not None:
            os.kill(proc.pid, sig)
        await asyncio.to_thread(proc.wait)
        return before, await watch.gone(), await watch.reason()

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    assert asyncio.run(run(sleeper, signal.SIGKILL)) == (False, True, "killed by signal SIGKILL")
    assert asyncio.run(run([sys.executable, "-c", "raise SystemExit(3)"], None))[1:] == (True, "exited with status 3")
    assert describe_status(-signal.SIGSEGV) == "killed by signal SIGSEGV"


def test_watch_of_a_server_that_is_not_our_child_uses_pid_and_start_time():
    """An adopted server: no exit status to read, so the reason says it is unknown."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        async def run() -> tuple[bool, bool, str]:
            watch = ServerWatch(_handle(proc.pid))  # as if adopted: no Popen handed over
            before = await watch.gone()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            return before, await watch.gone(), await watch.reason()

        before, after, reason = asyncio.run(run())
    finally:
        proc.kill()
        proc.wait()
    assert not before and after
    assert "exit status is unknown" in reason


# The server re-executes itself in place when told (a line on stdin): same pid, same start time.
REEXECS = (
    "import os, sys\n"
    "sys.stdin.readline()\n"
    "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
)


def test_a_server_re_executing_in_place_is_not_a_loss():
    """Issue 15 with Issue 11: a reload re-executes the control server in place; its watch (whether
    it is our child or adopted: pid + start time) never takes that for the server's end."""
    async def run(as_child: bool) -> tuple[bool, bool, bool]:
        proc = subprocess.Popen([sys.executable, "-c", REEXECS], stdin=subprocess.PIPE)
        try:
            watch = ServerWatch(_handle(proc.pid, proc if as_child else None, mode="child" if as_child else "detached"))
            before = await watch.gone()
            assert proc.stdin is not None
            proc.stdin.write(b"exec\n")
            proc.stdin.flush()
            await asyncio.to_thread(wait_until, lambda: "time.sleep(60)" in " ".join(psutil.Process(proc.pid).cmdline()),
                                    10)
            after_exec = await watch.gone()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            return before, after_exec, await watch.gone()
        finally:
            proc.kill()
            proc.wait()

    assert asyncio.run(run(as_child=True)) == (False, False, True)
    assert asyncio.run(run(as_child=False)) == (False, False, True)


def test_watch_without_a_pid_waits_for_nothing_to_listen(tmp_path):
    """No pid known: a dropped connection alone is no loss while something still listens at the
    endpoint, even without answering (a server re-executing keeps its listening socket open across
    the exec); refused connections, or no socket file, are."""
    path = str(tmp_path / "agentctl.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)  # never accepts: like a server in the middle of its exec
    handle = ControlServerHandle(endpoint=path, mode="detached", credential_ref="x", log_path="x", pid=None)
    closed = [False]
    watch = ServerWatch(handle, lambda: closed[0])
    try:
        assert asyncio.run(watch.gone()) is False  # the backend's connection is fine
        closed[0] = True
        assert asyncio.run(watch.gone()) is False  # dropped, but the socket still takes connections
    finally:
        listener.close()
    assert asyncio.run(watch.gone()) is True  # the file is left, but nothing listens: refused
    os.unlink(path)
    assert asyncio.run(watch.gone()) is True


def test_a_step_of_the_wall_clock_is_not_the_loss_of_an_adopted_server(monkeypatch):
    """The start an adopted server is watched by is its start in ticks since boot: a step of the
    wall clock (which moves psutil's create_time() of every process: the boot time it adds is
    derived from the wall clock at each read) is no loss, while its exit still is."""
    import psutil._pslinux as pslinux

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        async def run() -> tuple[bool, bool, bool]:
            watch = ServerWatch(_handle(proc.pid))  # as if adopted
            before = await watch.gone()
            real_boot_time = pslinux.boot_time
            monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + 7.0)  # the clock stepped 7 s
            stepped = await watch.gone()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            return before, stepped, await watch.gone()

        assert asyncio.run(run()) == (False, False, True)
    finally:
        proc.kill()
        proc.wait()


def test_a_launched_server_whose_pid_another_process_holds_is_gone_at_once():
    """A watch begun with a launch's recorded start time that another process's start does not
    match (the pid was reused) reports the server gone at its first look."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = psutil.Process(proc.pid).create_time()
        handle = _handle(proc.pid)
        handle.pid_start_time = start - 30.0  # recorded for another process that had this pid
        assert asyncio.run(ServerWatch(handle).gone()) is True
        handle.pid_start_time = start
        assert asyncio.run(ServerWatch(handle).gone()) is False
    finally:
        proc.kill()
        proc.wait()
