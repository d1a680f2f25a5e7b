"""Per-agent keys refused where they cannot be served (Issue 12 item 1), by the real daemons.

- the backend checks every ``secret_env`` file at start (missing, unsafe mode: it does not start,
  naming the key);
- the control server checks what its launch file names at its start (a systemd credential it was
  not given: it refuses to start, naming the key; the backend keeps running and says why);
- a key file that goes away later fails that agent's start with a typed error naming the key, and
  the session ends FAILED; other agents are unaffected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import CliError
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(180)


def _key(path: Path, mode: int = 0o600) -> Path:
    path.write_text("mock-secret-value\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode, words", [(None, "does not exist"), (0o644, "mode 0644")])
def test_backend_refuses_to_start_naming_the_key(short_tmp: Path, kandev_factory: Any, mode: int | None,
                                                 words: str) -> None:
    key = short_tmp / "key"
    if mode is not None:
        _key(key, mode)
    k = kandev_factory(config_text=f'[agents.mock]\nsecret_env = {{ MOCK_TOKEN = "{key}" }}\n')
    with pytest.raises(CliError) as err:
        k.up()
    # `kandev up` checks the configuration itself before starting anything (Issue 23 item 1), so the
    # refusal is the CLI's own; a backend log, if one was written, must not leak the value either
    log = k.home / "logs" / "backend.log"
    text = err.value.stdout + err.value.stderr
    assert "agents.mock.secret_env.MOCK_TOKEN" in text and words in text
    assert "mock-secret-value" not in text + (log.read_text(errors="replace") if log.exists() else "")
    assert k.run("status").returncode == 3  # nothing was started


def test_control_server_refuses_a_credential_it_was_not_given(kandev_factory: Any) -> None:
    k = kandev_factory(config_text='[agents.codex]\nsecret_env = { OPENAI_API_KEY = "credential:openai-key" }\n')
    k.up()  # the backend cannot see the control server's credentials: it starts, the server refuses
    log = k.home / "logs" / "backend.log"
    wait_until(lambda: "agents.codex.secret_env.OPENAI_API_KEY" in log.read_text(errors="replace"), timeout=30,
               message="the control server's refusal, naming the key, in the backend's log")
    text = log.read_text(errors="replace")
    assert "LoadCredential=openai-key" in text
    assert k.status()["backend"]["state"] == "ready"


def test_a_key_file_gone_later_fails_that_agent_naming_the_key(short_tmp: Path, kandev_factory: Any) -> None:
    key = _key(short_tmp / "key")
    k = kandev_factory(config_text=f'[agents.mock]\nsecret_env = {{ MOCK_TOKEN = "{key}" }}\n')
    k.up()
    _task, sid = k.start_session("with key")
    k.cli("prompt", sid, '/sh printf %s "$MOCK_TOKEN" | wc -c', "--wait")
    assert "\n17" in k.show(sid)["transcript"][-1]["text"]  # len("mock-secret-value"): the value, one newline off
    key.unlink()
    task = k.cli("task", "create", "--title", "key gone")["task_id"]
    p = k.run("session", "start", task)
    assert p.returncode == 1
    assert "agents.mock.secret_env.MOCK_TOKEN" in p.stdout and "does not exist" in p.stdout
    failed = [s for s in k.cli("session", "list")["sessions"] if s["state"] == "FAILED"]
    assert len(failed) == 1
    assert "agents.mock.secret_env.MOCK_TOKEN" in k.show(failed[0]["session_id"])["last_error"]
    assert k.show(sid)["live"]  # the running agent keeps its environment


def test_keys_settings_and_session_home_survive_a_control_server_reexec(short_tmp: Path, kandev_factory: Any) -> None:
    """Issue 12 with Issue 15: after ``kandev agentctl reload`` (a re-exec with the state handed
    over) the running agent still has its settings, its key and its session's HOME; a key file gone
    before the reload does not refuse it; a session started after the reload gets its key and its
    own HOME; the key's value is in no file under the home (the hand-over never carries it)."""
    key = _key(short_tmp / "key")
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", config_text=(
        f'[agents.mock]\nenv = {{ MOCK_SETTING = "plain-setting" }}\nsecret_env = {{ MOCK_TOKEN = "{key}" }}\n'))
    st = k.up()
    assert st["control_server"]["can_reload"]
    probe = '/sh printf "%s|%s|%s" "$(printf %s "$MOCK_TOKEN" | wc -c)" "$MOCK_SETTING" "$HOME"'

    def seen(sid: str) -> str:
        k.cli("prompt", sid, probe, "--wait")
        return str(k.show(sid)["transcript"][-1]["text"])

    _task, sid = k.start_session("before the reload")
    pid = k.show(sid)["agent_pid"]
    home = str(k.home / "sessions" / sid / "agent" / "home")
    assert f"17|plain-setting|{home}" in seen(sid)
    key.unlink()  # gone before the reload: the running agent has its key, the reload goes on
    out = k.cli("agentctl", "reload", timeout=200)
    assert out["outcome"] == "reexecuted", out
    assert k.show(sid)["agent_pid"] == pid and f"17|plain-setting|{home}" in seen(sid)

    _key(key)
    _task, sid2 = k.start_session("after the reload")
    assert f"17|plain-setting|{k.home / 'sessions' / sid2 / 'agent' / 'home'}" in seen(sid2)
    found = [p for p in k.home.rglob("*") if p.is_file() and b"mock-secret-value" in p.read_bytes()]
    assert found == []
