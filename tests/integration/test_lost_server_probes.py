"""Issue 11: the probes behind a control-server loss, on real processes.

``ServerWatch`` (daemon/backend/server_watch.py) tells a dead server from a live one by its exit
status when it is our child, else by pid + start time, and says why; ``stop_leftover_group``
(daemon/backend/liveness.py) kills what is left of a lost agent's process group only when the
identity matches. Real processes, each started and stopped here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from daemon.backend.launcher import ControlServerHandle
from daemon.backend.liveness import live_groups, stop_leftover_group
from daemon.backend.server_watch import ServerWatch, describe_status
from tests.helpers import wait_until
from tests.integration.conftest import alive, group_alive

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
    """Issue 11 build item 2: the agent is checked by pid + start time before its group is stopped."""
    leader, child = group
    start = psutil.Process(leader.pid).create_time()
    assert stop_leftover_group(leader.pid, start + 5.0) == "gone"  # another process holds the pid now
    assert alive(leader.pid) and alive(child)  # nothing was signalled
    assert stop_leftover_group(leader.pid, None) == "unknown"
    assert alive(leader.pid)
    assert stop_leftover_group(leader.pid, start) == "killed"
    wait_until(lambda: not group_alive(leader.pid), timeout=10)


def test_leftover_member_of_a_dead_leader_is_killed(group):
    """The leader died with its control server; what it left in its group goes too."""
    leader, child = group
    start = psutil.Process(leader.pid).create_time()
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    assert alive(child) and leader.pid in live_groups()
    assert stop_leftover_group(leader.pid, start) == "killed"
    wait_until(lambda: not alive(child), timeout=10)
    assert stop_leftover_group(leader.pid, start) == "gone"


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
