"""The registry of built-in agents (daemon/agents/registry.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.agents.registry import code_root, get_agent


def test_mock_agent_runs_as_a_module_of_this_interpreter_from_this_code_root(tmp_path):
    agent = get_agent("mock")
    assert agent.name == "mock"
    assert agent.version
    argv = agent.argv()
    assert argv[0] == sys.executable and argv[-2:] == [code_root(), "daemon.agents.mock"]
    assert (Path(code_root()) / "daemon" / "agents" / "mock.py").is_file()
    # the command imports the mock from the named root, whatever PYTHONPATH or import hooks say
    probe = [*argv[:-1], "daemon.version"]
    done = subprocess.run(probe, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_unknown_agent_is_a_keyerror_naming_the_known_ones():
    with pytest.raises(KeyError, match="unknown agent 'nope'.*mock"):
        get_agent("nope")
