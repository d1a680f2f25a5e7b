"""The registry of built-in agents (daemon/agents/registry.py)."""

from __future__ import annotations

import json
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
    assert (Path(code_root()) / "daemon" / "agents" / "mock" / "__main__.py").is_file()
    # the command imports the mock from the named root, whatever PYTHONPATH or import hooks say
    probe = [*argv[:-1], "daemon.core.version"]
    done = subprocess.run(probe, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_unknown_agent_is_a_keyerror_naming_the_known_ones():
    with pytest.raises(KeyError, match="unknown agent 'nope'.*mock"):
        get_agent("nope")


def test_the_acp_sdk_imported_lean_validates_the_same():
    """The control server imports the SDK with pydantic's attribute docstrings off and its models
    finished on first use (daemon/agentctl/acp_lean.py); a model still validates as before. In a
    child process: the settings are process-wide, and no other process of kandev takes them."""
    script = (
        "import json, sys\n"
        "lean = sys.argv[1] == 'lean'\n"
        "if lean:\n"
        "    import daemon.agentctl.acp_lean\n"
        "import acp.schema as s\n"
        "m = s.InitializeRequest\n"
        "before = m.__pydantic_complete__\n"
        "r = m.model_validate({'protocolVersion': 1, 'clientCapabilities': {'fs': {'readTextFile': True}}})\n"
        "print(json.dumps([before, m.model_fields['protocol_version'].description is None,\n"
        "                  r.model_dump(by_alias=True, exclude_none=True)]))\n"
    )
    out = {}
    for mode in ("lean", "plain"):
        done = subprocess.run([sys.executable, "-c", script, mode], cwd=code_root(), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out[mode] = json.loads(done.stdout)
    assert out["lean"][:2] == [False, True]  # deferred, no docstring read from schema.py's source
    assert out["plain"][:2] == [True, False]  # pydantic's defaults where daemon.agentctl.acp_lean is not imported
    assert out["lean"][2] == out["plain"][2]
