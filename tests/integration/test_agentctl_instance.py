"""``daemon.agentctl.instance.instance.Instance`` in-process, against real agent processes.

What the server tests cannot reach quickly: a handshake that times out, a stop
racing a start, and the SIGTERM -> SIGKILL escalation. Every process group a
test starts is killed in teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.agentctl.instance.conversation import TurnIds
from daemon.agentctl.instance.instance import Instance, InstanceState
from daemon.agentctl.instance.process import KILL_GRACE, InstanceSpec
from ipc.errors import ErrorCode, IpcError
from tests.support.aio import run
from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
MOCK = [sys.executable, "-m", "daemon.agents.mock"]

pytestmark = pytest.mark.timeout(120)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def groups() -> Iterator[set[int]]:
    """Process groups a test started; SIGKILLed in teardown."""
    started: set[int] = set()
    yield started
    for pgid in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _instance(tmp_path: Path, command: list[str], **kw: Any) -> Instance:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    spec = InstanceSpec(
        instance_id=os.urandom(16).hex(),
        session_id="s",
        task_id="t",
        command=command,
        cwd=str(workspace),
        env={"KANDEV_MOCK_STATE_DIR": str(tmp_path / "mock"), "PYTHONPATH": str(REPO)},
    )
    return Instance(spec, agent_log_dir=tmp_path / "agents", turn_ids=TurnIds("test"), **kw)


def test_handshake_timeout_kills_the_group(tmp_path: Path, groups: set[int]):
    """An agent that never answers initialize: agent_error after the bound, group killed."""

    async def scenario() -> tuple[IpcError, Instance, float]:
        inst = _instance(tmp_path, ["sleep", "300"], handshake_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(IpcError) as info:
            await inst.start()
        if inst.pid:
            groups.add(inst.pid)
        return info.value, inst, time.monotonic() - started

    error, inst, elapsed = run(scenario())
    assert error.code == ErrorCode.AGENT_ERROR and "no answer to initialize within 1 s" in error.message
    assert elapsed < 1.0 + KILL_GRACE + 2
    assert inst.state is InstanceState.STOPPED
    assert not _group_exists(inst.pid)


def test_stop_during_start_leaves_nothing(tmp_path: Path, groups: set[int]):
    async def scenario() -> Instance:
        inst = _instance(tmp_path, ["sleep", "300"], handshake_timeout=30.0)
        start = asyncio.ensure_future(inst.start())
        await eventually(lambda: inst.pid is not None, 30, interval=0.01, message="the agent spawned")
        groups.add(inst.pid)
        assert await inst.stop() is True
        with pytest.raises(IpcError):
            await start
        assert await inst.stop() is False  # already stopped
        return inst

    inst = run(scenario())
    assert inst.state is InstanceState.STOPPED
    assert not _group_exists(inst.pid)


def test_stop_escalates_to_sigkill_and_never_blocks(tmp_path: Path, groups: set[int]):
    """An agent ignoring SIGTERM is SIGKILLed after the grace period (AC-EXECUTORS-SURVIVAL-001.10: stop completes)."""
    stubborn = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # stays ignored across exec
        "os.execv(sys.executable, [sys.executable, '-m', 'daemon.agents.mock'])\n"
    )

    async def scenario() -> tuple[Instance, float]:
        inst = _instance(tmp_path, [sys.executable, "-c", stubborn])
        await inst.start()
        groups.add(inst.pid)
        inst.prompt("/slow 30")
        started = time.monotonic()
        await inst.stop()
        return inst, time.monotonic() - started

    inst, elapsed = run(scenario())
    assert KILL_GRACE - 0.2 <= elapsed < KILL_GRACE + 5
    assert inst.exit_code == -signal.SIGKILL
    assert not _group_exists(inst.pid)


def test_identity_check_refuses_a_reused_pid(tmp_path: Path, groups: set[int]):
    """docs/architecture.md#the-control-server-inside: never signal a pid without checking (pid, start time): a pid now held by a
    process with another start time is left alone."""
    import subprocess

    import psutil

    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    groups.add(other.pid)

    async def scenario() -> tuple[bool, bool]:
        inst = _instance(tmp_path, MOCK)
        await inst.start()
        groups.add(inst.pid)
        group = inst.group
        real_proc, real_pid = group.psproc, group.pid
        try:
            # The recorded identity says "pid X started at time T"; X is now someone else.
            stale = psutil.Process(other.pid)
            stale._ident = (other.pid, stale._ident[1] - 100.0)
            group.psproc, group.pid = stale, other.pid
            sent = group.signal_group(signal.SIGKILL)
        finally:
            group.psproc, group.pid = real_proc, real_pid
        signalled_own = group.signal_group(0)
        await inst.stop()
        return sent, signalled_own

    sent, signalled_own = run(scenario())
    assert sent is False and signalled_own is True
    assert other.poll() is None  # the stranger was not touched
    other.kill()
    other.wait(10)
