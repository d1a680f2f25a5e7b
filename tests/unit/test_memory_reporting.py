"""Issue 45 scenario B (what people are told): where agents' memory cannot be bounded, ``kandev status``
warns that it is unbounded and why, and ``kandev doctor``'s ``agent_memory`` fails with the reason and
a hint, whether the running control server said so or only the host's controller is known; an agent
its bound killed gets a board hint naming ``max_memory``. (Reproducing an unbounded host needs a host
without delegation, which this build host is not: the reports are checked on their inputs.)"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from daemon.backend.state.events import killed_by_memory
from daemon.cli.doctor import DoctorProbes, run_doctor
from daemon.cli.human.status import warnings
from daemon.host.paths import Paths
from daemon.store.board import MEMORY_KILLED, attention_hint
from daemon.store.states import Attention

UNBOUNDED = {"bounded": False, "hierarchy": "v2", "cgroup": None, "max_memory": 1 << 30, "per_agent": {},
             "reason": "the memory controller is not available in the control server's cgroup /x (its unit needs"
                       " Delegate=yes)"}


def _doctor(tmp_path: Path, status: dict[str, Any] | None, controller: tuple[str | None, str]) -> Any:
    """``agent_memory`` of a home whose backend socket answers ``status`` (None: no backend)."""
    paths = Paths.for_home(tmp_path / "home")
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.home, 0o750)
    os.chmod(paths.run_dir, 0o750)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        if not paths.backend_socket.exists():
            listening.bind(str(paths.backend_socket))
            os.chmod(paths.backend_socket, 0o660)
        probes = replace(DoctorProbes(), backend_status=lambda sock: status, memory_controller=lambda: controller)
        checks = run_doctor(paths, env={}, probes=probes)
    return next(c for c in checks if c.name == "agent_memory")


def test_status_warns_that_memory_is_unbounded_and_why() -> None:
    """Issue 45 scenario B: ``kandev status`` says agents' memory is unbounded, with the reason."""
    found = warnings({"backend": {"state": "ready"}, "memory": UNBOUNDED})
    assert any("memory is unbounded" in w and "Delegate=yes" in w for w in found), found
    assert not any("memory" in w for w in warnings({"backend": {"state": "ready"},
                                                     "memory": {**UNBOUNDED, "bounded": True, "reason": None}}))


def test_doctor_says_memory_is_unbounded_and_why(tmp_path: Path) -> None:
    """Issue 45 scenario B: ``kandev doctor`` fails ``agent_memory`` with the control server's reason,
    or, with no control server to ask, the host's; it passes where agents are bounded."""
    check = _doctor(tmp_path, {"memory": UNBOUNDED}, ("v2", "ignored"))
    assert not check.ok and "UNBOUNDED" in check.detail and "Delegate=yes" in check.detail and check.hint
    check = _doctor(tmp_path, None, (None, "this host has no memory cgroup controller (...)"))
    assert not check.ok and "no memory cgroup controller" in check.detail and check.hint
    check = _doctor(tmp_path, {"memory": {**UNBOUNDED, "bounded": True, "hierarchy": "v1", "cgroup": "/m/x",
                                          "reason": None}}, (None, "ignored"))
    assert check.ok and "below /m/x" in check.detail


def test_a_memory_kill_says_so_and_the_board_names_the_setting() -> None:
    """Issue 45 scenario B: the session's error starts with the typed kill and its reason; the board's
    hint names the agent's ``max_memory``."""
    error = killed_by_memory(192 << 20, "SIGKILL", -9)
    assert error.startswith(MEMORY_KILLED) and "192 MiB" in error and "SIGKILL" in error
    hint = attention_hint(Attention.FAILED, "mock", error)
    assert hint and "agents.mock.max_memory" in hint
    assert attention_hint(Attention.FAILED, "mock", "agent killed by SIGKILL (exit code -9)") is None
