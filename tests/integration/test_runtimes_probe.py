"""The runtime probe and command runner against real processes (RESUME-11: success only after ACP init).

The probe speaks ACP ``initialize`` to the real mock agent (written with the
SDK); it must report the protocol version, and it must stop the whole process
group whatever happened. The runner's time limit kills npm's whole group too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import acp
import pytest

from daemon.runtimes.probe import acp_probe
from daemon.runtimes.proc import CommandRunner
from tests.support.aio import run
from tests.support.processes import alive, group_alive
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO)
    e["KANDEV_MOCK_STATE_DIR"] = str(tmp_path / "mock-state")
    return e


def test_probe_reports_the_protocol_version_of_a_real_acp_agent(tmp_path: Path) -> None:
    result = run(acp_probe([sys.executable, "-m", "daemon.agents.mock"], cwd=tmp_path, env=env(tmp_path),
                           timeout=30))
    assert result.ok, result.detail
    assert result.protocol_version == acp.PROTOCOL_VERSION == 1
    assert result.duration_s < 30


def _pid_file_argv(pid_file: Path, body: str) -> list[str]:
    """A process that records the pid of a child it leaves in its group, then runs ``body``."""
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        + body
    )
    return [sys.executable, "-c", code]


def _pids(pid_file: Path) -> tuple[int, int]:
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=10)
    leader, child = (int(x) for x in pid_file.read_text().split())
    return leader, child


def test_probe_of_a_silent_process_times_out_and_kills_its_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    argv = _pid_file_argv(pid_file, "time.sleep(300)\n")
    result = run(acp_probe(argv, cwd=tmp_path, env=env(tmp_path), timeout=2))
    assert not result.ok and "no answer to initialize within 2 s" in result.detail
    leader, child = _pids(pid_file)
    wait_until(lambda: not alive(child) and not group_alive(leader), timeout=10)


def test_probe_of_a_process_that_exits_reports_why(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('SyntaxError: Unexpected end of input\\n'); "
            "sys.exit(1)"]
    result = run(acp_probe(argv, cwd=tmp_path, env=env(tmp_path), timeout=20))
    assert not result.ok and result.protocol_version is None
    assert "exit code 1" in result.detail and "Unexpected end of input" in result.detail


def test_probe_of_a_missing_command(tmp_path: Path) -> None:
    result = run(acp_probe([str(tmp_path / "no-such-npx")], cwd=tmp_path, env=env(tmp_path), timeout=5))
    assert not result.ok and "cannot start" in result.detail


def test_runner_time_limit_kills_the_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    argv = _pid_file_argv(pid_file, "print('working', flush=True); time.sleep(300)\n")
    result = run(CommandRunner(tmp_path, env(tmp_path)).run(argv, timeout=2))
    assert result.timed_out and not result.ok and result.returncode is None
    assert "working" in result.stdout and "timed out" in result.failure()
    leader, child = _pids(pid_file)
    wait_until(lambda: not alive(child) and not group_alive(leader), timeout=10)


def test_runner_output_is_bounded_and_direct_argv(tmp_path: Path) -> None:
    runner = CommandRunner(tmp_path, env(tmp_path), output_limit=1000)
    # A shell metacharacter in an argument is just text: no shell ever runs.
    result = run(runner.run([sys.executable, "-c", "import sys; print(sys.argv[1]); print('x' * 100000)",
                             "; touch pwned"], timeout=20))
    assert result.ok and len(result.stdout) <= 1000 and result.stdout.rstrip().endswith("x")
    assert not (tmp_path / "pwned").exists()
    missing = run(runner.run([str(tmp_path / "nope")], timeout=5))
    assert not missing.ok and "cannot run" in missing.failure()


@pytest.mark.parametrize("code", [0, 3])
def test_runner_reports_the_exit_code(tmp_path: Path, code: int) -> None:
    result = run(CommandRunner(tmp_path, env(tmp_path)).run(
        [sys.executable, "-c", f"import sys; sys.stderr.write('npm error boom\\n'); sys.exit({code})"], timeout=20))
    assert result.returncode == code and result.ok == (code == 0)
    if code:
        assert result.failure() == "exit code 3: npm error boom"
