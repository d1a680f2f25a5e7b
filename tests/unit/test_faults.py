"""Fault injection behind one interface (daemon/core/faults.py): each fault declared once, every call
site in the product names a declared fault of the right kind, and a fault switched on through
``$KANDEV_FAULT_FILE`` acts at once and stops when switched off (Issue 13 item 3)."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.core import faults
from daemon.core.faults import FAULTS, FaultKind
from ipc.errors import ErrorCode, IpcError

REPO = Path(__file__).resolve().parents[2]
CALL = re.compile(r"faults\.(hit|delay|active)\(\s*\"([^\"]+)\"")
KINDS = {"hit": {FaultKind.KILL, FaultKind.FAIL}, "delay": {FaultKind.DELAY}, "active": {FaultKind.ALTER}}


@pytest.fixture
def fault_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "faults"
    monkeypatch.delenv(faults.ENV, raising=False)
    monkeypatch.setenv(faults.FILE_ENV, str(path))
    return path


def test_every_fault_is_declared_with_a_doc_line_and_its_kind() -> None:
    for name, fault in FAULTS.items():
        assert fault.name == name and fault.doc.strip()
        assert (fault.error is not None and bool(fault.message)) == (fault.kind is FaultKind.FAIL)


def test_every_call_site_names_a_declared_fault_of_its_kind_and_every_fault_is_used() -> None:
    used: set[str] = set()
    for path in sorted((REPO / "daemon").rglob("*.py")):
        if path.name == "faults.py":
            continue
        for call, name in CALL.findall(path.read_text(encoding="utf-8")):
            assert name in FAULTS, f"{path}: unknown fault {name}"
            assert FAULTS[name].kind in KINDS[call], f"{path}: faults.{call}({name!r}) on a {FAULTS[name].kind}"
            used.add(name)
    assert used == set(FAULTS), f"declared but never used: {sorted(set(FAULTS) - used)}"


def test_unknown_or_misused_fault_is_a_value_error(fault_file: Path) -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        faults.hit("no_such_fault")
    with pytest.raises(ValueError, match="delay fault"):
        faults.hit("agentctl_slow_rotate")
    with pytest.raises(ValueError):
        faults.active("agentctl_stop_fails")
    with pytest.raises(ValueError):
        faults.delay_seconds("agentctl_lacks_turns")


def test_a_failure_raises_its_declared_error_only_while_switched_on(fault_file: Path) -> None:
    faults.hit("agentctl_lacks_shutdown")  # no file yet: off
    fault_file.write_text("agentctl_stop_fails\nagentctl_lacks_shutdown\n")
    with pytest.raises(IpcError) as err:
        faults.hit("agentctl_lacks_shutdown")
    assert err.value.code == ErrorCode.UNKNOWN_OP
    with pytest.raises(IpcError) as err:
        faults.hit("agentctl_stop_fails")
    assert err.value.code == ErrorCode.INTERNAL
    fault_file.write_text("agentctl_stop_fails")
    faults.hit("agentctl_lacks_shutdown")  # switched off without restarting anything
    assert not faults.active("agentctl_lacks_turns")


def test_the_environment_variable_and_the_file_combine(fault_file: Path, monkeypatch) -> None:
    monkeypatch.setenv(faults.ENV, "agentctl_lacks_turns")
    fault_file.write_text("agentctl_slow_rotate:0.01,agentctl_slow_enumeration:soon")
    assert faults.active("agentctl_lacks_turns")
    assert faults.delay_seconds("agentctl_slow_rotate") == 0.01
    assert faults.delay_seconds("agentctl_slow_enumeration") == 0.0  # unparsable: no delay
    asyncio.run(faults.delay("agentctl_slow_rotate"))


def test_a_kill_point_kills_the_process_with_sigkill(fault_file: Path, monkeypatch) -> None:
    fault_file.write_text("adopt_after_secret")
    script = ("from daemon.core import faults\n"
              "faults.hit('adopt_after_rotate')\n"  # off: passes
              "print('past rotate', flush=True)\n"
              "faults.hit('adopt_after_secret')\n"
              "print('past secret', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL
    assert proc.stdout.splitlines() == ["past rotate"]
