"""A reload hands each agent's identity to the next image (``AgentProcess.identity_handover`` and
``resume_identity``): its start in ticks since boot, so a step of the wall clock between the
agent's launch and the reload (which moves psutil's create_time() of every process) does not make
the next image take its own agent for another process. Real processes, started and stopped here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import psutil
import psutil._pslinux as pslinux
import pytest

from daemon.agentctl.instance.process import AgentProcess


@pytest.fixture
def agent() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _launched(pid: int) -> AgentProcess:
    """The image that launched it: pid, wall-clock start and psutil identity, as after ``spawn``."""
    group = AgentProcess(sandboxed=False)
    group.pid, group.psproc = pid, psutil.Process(pid)
    group.pid_start_time = group.psproc.create_time()
    return group


def _next_image(launched: AgentProcess) -> AgentProcess:
    """The next image's view before it resumes (``instance_handover.restore``)."""
    group = AgentProcess(sandboxed=False)
    group.pid, group.pid_start_time = launched.pid, launched.pid_start_time
    return group


def test_a_wall_clock_step_before_a_reload_keeps_the_agents_identity(agent, monkeypatch) -> None:
    launched = _launched(agent.pid)
    handed = launched.identity_handover()
    assert isinstance(handed["pid_start_ticks"], int)
    real_boot_time = pslinux.boot_time
    monkeypatch.setattr(pslinux, "boot_time", lambda: real_boot_time() + 7.0)  # the clock stepped 7 s
    resumed = _next_image(launched)
    assert resumed.resume_identity(None, None, handed["pid_start_ticks"]) is None
    assert resumed.psproc is not None and resumed.psproc.pid == agent.pid
    # an image before 0.3.0 handed over the wall-clock start only: after the step it no longer matches
    legacy = _next_image(launched)
    assert legacy.resume_identity(None, None) == "process identity (the start time differs)"


def test_another_process_under_the_agents_pid_is_not_taken_for_it(agent) -> None:
    launched = _launched(agent.pid)
    handed = launched.identity_handover()
    resumed = _next_image(launched)
    assert resumed.resume_identity(None, None, handed["pid_start_ticks"] + 1) == \
        "process identity (the start time differs)"
    assert resumed.psproc is None
