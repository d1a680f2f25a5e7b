"""The inspection commands read the running backend's configuration, and key files are checked
before any session starts (Issue 46 Why 3 and Issue 46 Why 4), through the real CLI and daemons;
each test fails on the behaviour before the fix (Issue 46 scenario A).

- ``kandev agents`` and ``kandev doctor`` describe the configuration the running backend was
  started with (``kandev up --config FILE``), asked over its socket, whatever file the shell's
  ``$KANDEV_CONFIG`` names; ``--config`` names another file; with no backend, the file ``kandev
  up`` would use. Each says which file it read.
- A key file that is empty (or a lone newline), missing or of a loose mode stops ``kandev up``
  and fails ``kandev doctor``, named with its key and the fix; one emptied while the backend runs
  is found by ``doctor`` (as the backend's user sees it) and refuses the session's start with an
  error that starts with what went wrong, not with an internal word such as ``create_instance``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev

pytestmark = pytest.mark.timeout(180)

VALUE = "sk-never-shown"


def _key(path: Path, text: str = VALUE + "\n", mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _up(k: Kandev, *args: str) -> dict[str, Any]:
    st: dict[str, Any] = k.cli("up", *args, timeout=450)["status"]
    k.backend_pids.add(int(st["backend"]["pid"]))
    if st["control_server"]["pid"]:
        k.server_pids.add(int(st["control_server"]["pid"]))
    return st


def _row(out: str, agent: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [agent])


def _checks(k: Kandev, *args: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads(k.run("doctor", *args).stdout)["checks"]}


def test_agents_and_doctor_read_the_running_backends_configuration(short_tmp: Path, kandev_factory: Any) -> None:
    """Issue 46 Why 3 (Issue 46 item 3): after ``kandev up --config FILE`` (the shell's $KANDEV_CONFIG names
    another, empty, file), ``agents`` shows FILE's secret_env and ``doctor`` FILE's [agents.NAME] settings,
    each naming FILE as the running backend's; ``--config`` reads the file it names; with the backend down
    they read the file ``kandev up`` would use, and say so."""
    key = _key(short_tmp / "anthropic.key")
    k = kandev_factory()
    shell_config = k.env["KANDEV_CONFIG"]
    running = short_tmp / "running.toml"
    running.write_text(f'[agents.claude-code]\nsecret_env = {{ ANTHROPIC_API_KEY = "{key}" }}\n')
    _up(k, "--config", str(running))

    p = k.human("agents")
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith(f"Configuration: {running} (the running backend's"), first
    assert p.stdout.splitlines()[2].split()[:4] == ["AGENT", "PACKAGE", "VERSION", "SECRET_ENV"]
    assert f"ANTHROPIC_API_KEY <- {key}" in _row(p.stdout, "claude-code")
    listed = k.cli("agents")
    assert (listed["config"], listed["read_by"]) == (str(running), "backend")
    claude = next(a for a in listed["agents"] if a["name"] == "claude-code")
    assert claude["secret_env"] == {"ANTHROPIC_API_KEY": str(key)}

    checks = _checks(k)
    assert str(running) in checks["config"]["detail"] and "running backend" in checks["config"]["detail"]
    assert "claude-code" in checks["agents"]["detail"] and "ANTHROPIC_API_KEY" in checks["agents"]["detail"]
    assert str(key) in checks["agents"]["detail"]
    human = k.human("doctor")
    assert f"Configuration: {running}" in human.stdout
    assert VALUE not in p.stdout + json.dumps(listed) + json.dumps(checks) + human.stdout

    # --config names another file: that one, read by the command itself
    named = k.cli("agents", "--config", shell_config)
    assert (named["config"], named["read_by"]) == (shell_config, "this command")
    assert next(a for a in named["agents"] if a["name"] == "claude-code")["secret_env"] == {}
    assert "no [agents.NAME] settings" in _checks(k, "--config", shell_config)["agents"]["detail"]

    # no backend: the file `kandev up` would start one with, and why that one
    k.cli("down")
    alone = k.human("agents")
    assert alone.stdout.startswith(f"Configuration: {shell_config} (no backend answers"), alone.stdout
    assert "secret_env" not in json.dumps(k.cli("agents")["problems"])
    assert "no backend answers" in _checks(k)["config"]["detail"]


@pytest.mark.parametrize("problem, what, fix", [
    ("empty", "is empty", "printf '%s' \"$MOCK_TOKEN\" >"),
    ("newline", "is empty", "printf '%s' \"$MOCK_TOKEN\" >"),
    ("mode", "has mode 0644", "chmod 600"),
    ("missing", "does not exist", "install -m 600 /dev/null"),
])
def test_up_and_doctor_name_a_bad_key_file_with_its_key_and_fix(short_tmp: Path, kandev_factory: Any, problem: str,
                                                               what: str, fix: str) -> None:
    """Issue 46 Why 4 (Issue 46 item 4): an empty (or lone-newline), wrong-mode or missing key file stops
    ``kandev up`` before anything starts, and ``kandev doctor`` fails a check named by its key; both say what
    is wrong and the fix."""
    key = short_tmp / "token"
    if problem != "missing":
        _key(key, {"empty": "", "newline": "\n"}.get(problem, VALUE), 0o644 if problem == "mode" else 0o600)
    k = kandev_factory(config_text=f'[agents.mock]\nsecret_env = {{ MOCK_TOKEN = "{key}" }}\n')

    up = k.human("up")
    assert up.returncode == 1, up.stdout + up.stderr
    first = up.stderr.splitlines()[0]
    assert first.startswith("kandev: the configuration is refused, nothing was started:"), up.stderr
    assert "agents.mock.secret_env.MOCK_TOKEN" in first and what in first and "; fix: " in first and fix in first
    assert k.run("status").returncode == 3  # nothing was started

    check = _checks(k)["agents.mock.secret_env.MOCK_TOKEN"]
    assert not check["ok"] and what in check["detail"] and fix in check["hint"], check
    assert VALUE not in up.stderr + json.dumps(check)


def test_a_key_file_emptied_under_a_running_backend(short_tmp: Path, kandev_factory: Any) -> None:
    """Issue 46 Why 4 (Issue 46 item 4): a key file emptied while the backend runs: ``doctor`` (asking the
    backend, which checks it as its own user) fails its check with the fix, and a session start is refused
    with an error that says what went wrong first, names the key and the fix, and no internal word such as
    ``create_instance``."""
    key = _key(short_tmp / "token")
    k = kandev_factory(config_text=f'[agents.mock]\nsecret_env = {{ MOCK_TOKEN = "{key}" }}\n')
    _up(k)
    assert "agents.mock.secret_env.MOCK_TOKEN" not in _checks(k)
    key.write_text("")

    check = _checks(k)["agents.mock.secret_env.MOCK_TOKEN"]
    assert not check["ok"] and "is empty" in check["detail"] and "printf" in check["hint"], check
    task = k.cli("task", "create", "--title", "emptied key")["task_id"]
    p = k.human("session", "start", task)
    assert p.returncode == 1, p.stdout
    first = p.stderr.splitlines()[0]
    assert first.startswith("kandev: agent failed to start: the agent's key cannot be read: "), p.stderr
    assert "agents.mock.secret_env.MOCK_TOKEN" in first and "is empty" in first and "fix:" in first, first
    assert "create_instance" not in p.stderr
