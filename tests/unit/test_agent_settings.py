"""Per-agent settings and keys (Issue 12 item 1): parsing, the checks of secret files and
systemd credentials, and what crosses to the control server (references only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.agentctl import launch
from daemon.agentctl.sandbox import agent_env
from daemon.agentctl.sandbox.bubblewrap import SandboxRequest
from daemon.agents.file_checks import file_problems
from daemon.agents.settings import SecretKind, SecretRef, SettingsError, describe
from daemon.agents.settings import agent_env as plain_env
from daemon.config.keys import ConfigError
from daemon.config.settings import load_config, validate_backend


def _secret(path: Path, value: str = "s3cret-value", mode: int = 0o600) -> Path:
    path.write_text(value + "\n")
    path.chmod(mode)
    return path


def _config(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kandev.toml"
    p.write_text(text)
    return p


def test_agent_tables_parse_with_defaults_and_names_only(tmp_path: Path) -> None:
    key = _secret(tmp_path / "key")
    cfg = load_config(str(_config(tmp_path, (
        '[agents]\nsandbox = "required"\n[agents.claude-code]\n'
        'env = { ANTHROPIC_BASE_URL = "http://127.0.0.1:1", DISABLE_TELEMETRY = "0" }\n'
        f'secret_env = {{ ANTHROPIC_API_KEY = "{key}", OTHER = "credential:anthropic-api-key" }}\n'))), env={})
    validate_backend(cfg)
    s = cfg.agents.settings["claude-code"]
    assert s.secret_env["ANTHROPIC_API_KEY"] == SecretRef(SecretKind.FILE, str(key))
    assert s.secret_env["OTHER"] == SecretRef(SecretKind.CREDENTIAL, "anthropic-api-key")
    env = plain_env("claude-code", cfg.agents.settings)
    assert env == {"ANTHROPIC_BASE_URL": "http://127.0.0.1:1", "DISABLE_TELEMETRY": "0",
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # the operator's value wins
    assert plain_env("codex", cfg.agents.settings) == {}
    shown = describe(cfg.agents.settings, "claude-code")
    assert shown == {"env": ["ANTHROPIC_BASE_URL", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY"],
                     "secret_env": {"ANTHROPIC_API_KEY": str(key), "OTHER": "credential:anthropic-api-key"},
                     "home_files": {}}
    assert "s3cret" not in repr(cfg)


@pytest.mark.parametrize("text, key, words", [
    ('[agents.nope]\nenv = {}\n', "agents.nope", "unknown agent"),
    ('[agents.mock]\nfoo = 1\n', "agents.mock.foo", "unknown setting"),
    ('[agents.mock]\nenv = { HOME = "/x" }\n', "agents.mock.env.HOME", "set by kandev"),
    ('[agents.mock]\nenv = { KANDEV_X = "1" }\n', "agents.mock.env.KANDEV_X", "set by kandev"),
    ('[agents.mock]\nenv = { "A-B" = "1" }\n', "agents.mock.env.A-B", "not an environment variable"),
    ('[agents.mock]\nenv = { A = 1 }\n', "agents.mock.env.A", "must be a string"),
    ('[agents.mock]\nsecret_env = { A = "relative/key" }\n', "agents.mock.secret_env.A", "absolute"),
    ('[agents.mock]\nsecret_env = { A = "credential:a/b" }\n', "agents.mock.secret_env.A", "credential name"),
    ('[agents.mock]\nsecret_env = { A = "credential:agentctl-credential" }\n', "agents.mock.secret_env.A",
     "control server's own"),
    ('[agents.mock]\nenv = { A = "1" }\nsecret_env = { A = "/k" }\n', "agents.mock.secret_env.A", "either plain"),
])
def test_bad_agent_tables_are_refused_naming_the_key(tmp_path: Path, text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(str(_config(tmp_path, text)), env={})
    assert err.value.key == key and key in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("mode, ok", [(0o600, True), (0o640, True), (0o400, True), (0o644, False),
                                      (0o660, False), (0o700, False), (0o604, False)])
def test_secret_file_modes(tmp_path: Path, mode: int, ok: bool) -> None:
    """0600 or 0640 (0400/0440) only; anything else is refused at start, naming the key."""
    key = _secret(tmp_path / "key", mode=mode)
    cfg = load_config(str(_config(tmp_path, f'[agents.mock]\nsecret_env = {{ T = "{key}" }}\n')), env={})
    if ok:
        validate_backend(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate_backend(cfg)
    assert err.value.key == "agents.mock.secret_env.T" and f"{mode:04o}" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_missing_and_symlinked_secret_files_are_refused(tmp_path: Path) -> None:
    real = _secret(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    for path, words in ((tmp_path / "absent", "does not exist"), (tmp_path / "link", "symlink")):
        cfg = load_config(str(_config(tmp_path, f'[agents.codex]\nsecret_env = {{ OPENAI_API_KEY = "{path}" }}\n')),
                          env={})
        with pytest.raises(ConfigError, match=words) as err:
            validate_backend(cfg)
        assert err.value.key == "agents.codex.secret_env.OPENAI_API_KEY"


def test_foreign_owner_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file another owner")
    key = _secret(tmp_path / "key")
    os.chown(key, 4242, 4242)
    with pytest.raises(ValueError, match="owned by uid 4242"):
        agent_env.read_secret(SecretRef(SecretKind.FILE, str(key)), None)


def test_values_are_read_by_the_server_side_only(tmp_path: Path) -> None:
    """The control server's reading: a file (one trailing newline dropped), a systemd credential,
    refusals naming the key and the reference, never the value."""
    key = _secret(tmp_path / "key", "line-one")
    creds = tmp_path / "creds"
    creds.mkdir()
    _secret(creds / "api", "from-credential", mode=0o400)
    refs = agent_env.parse_refs({"A": str(key), "B": "credential:api"}, "agents.mock.secret_env")
    assert agent_env.resolve(refs, "agents.mock.secret_env", credentials_dir=str(creds)) == {
        "A": "line-one", "B": "from-credential"}
    with pytest.raises(agent_env.SecretUnavailable, match=r"agents\.mock\.secret_env\.B = 'credential:api'.*"
                       "CREDENTIALS_DIRECTORY is unset"):
        agent_env.resolve(refs, "agents.mock.secret_env", credentials_dir=None)
    missing = agent_env.parse_refs({"C": "credential:nope"}, "k")
    with pytest.raises(agent_env.SecretUnavailable, match="LoadCredential=nope:"):
        agent_env.resolve(missing, "k", credentials_dir=str(creds))
    with pytest.raises(agent_env.SecretUnavailable, match="control server's own") as err:
        agent_env.resolve(refs, "k", credentials_dir=str(creds), forbidden=[str(tmp_path)])
    assert "line-one" not in str(err.value)
    empty = _secret(tmp_path / "empty", "")
    with pytest.raises(agent_env.SecretUnavailable, match="is empty"):
        agent_env.resolve({"E": SecretRef(SecretKind.FILE, str(empty))}, "k", credentials_dir=None)


def test_launch_file_carries_references_and_the_server_checks_them_at_start(tmp_path: Path) -> None:
    key = _secret(tmp_path / "key", "never-in-the-launch-file")
    cfg = launch.LaunchConfig(socket_path=str(tmp_path / "run/s.sock"), log_path=str(tmp_path / "logs/a.log"),
                              agent_log_dir=str(tmp_path / "logs/agents"), installation_id="i",
                              agent_secret_env={"claude-code": {"ANTHROPIC_API_KEY": str(key)}})
    path = tmp_path / "launch.json"
    launch.dump(cfg, path)
    assert "never-in-the-launch-file" not in path.read_text()
    loaded = launch.load(path)
    assert loaded.agent_secret_env == {"claude-code": {"ANTHROPIC_API_KEY": str(key)}}
    launch.validate(loaded)
    key.chmod(0o644)
    with pytest.raises(ConfigError) as err:
        launch.validate(loaded)
    assert err.value.key == "agents.claude-code.secret_env.ANTHROPIC_API_KEY" and "0644" in str(err.value)
    bad = launch.LaunchConfig(**{**cfg.to_json(), "agent_secret_env": {"mock": {"X": "relative"}}})
    launch.dump(bad, path)
    with pytest.raises(launch.LaunchError, match="agents.mock.secret_env.X"):
        launch.load(path)


def test_every_secret_file_is_hidden_in_every_sandbox() -> None:
    request = SandboxRequest(hidden=("/home/kandev",), max_processes=77)
    configured = {"claude-code": {"K": SecretRef(SecretKind.FILE, "/etc/keys/a")},
                  "codex": {"C": SecretRef(SecretKind.CREDENTIAL, "c")}}
    out = agent_env.hide_secret_files(request, configured, {"M": "/srv/keys/mock"})
    assert out.hidden == ("/home/kandev", "/etc/keys/a", "/srv/keys/mock")
    assert out.max_processes == 77  # hiding secrets keeps the rest of the request (it once dropped the bound)


def test_settings_error_names_its_key() -> None:
    with pytest.raises(SettingsError) as err:
        SecretRef.parse(5, "agents.mock.secret_env.X")
    assert err.value.key == "agents.mock.secret_env.X"


@pytest.mark.parametrize("text, empty", [("", True), ("\n", True), ("\r\n", True), ("k", False), ("k\n", False)])
def test_an_empty_key_file_is_a_problem_named_with_its_fix(tmp_path: Path, text: str, empty: bool) -> None:
    """Issue 46 Why 4: a key file holding nothing but a line break is refused at start, naming the
    key and the fix; a one-character key is a key. A home_files source may be empty."""
    key = tmp_path / "key"
    key.write_text(text, newline="")
    key.chmod(0o600)
    cfg = load_config(str(_config(tmp_path, f'[agents.mock]\nsecret_env = {{ T = "{key}" }}\n'
                                             f'home_files = {{ "a.json" = "{key}" }}\n')), env={})
    problems = file_problems(cfg.agents.settings)
    assert [p.key for p in problems] == (["agents.mock.secret_env.T"] if empty else [])
    if empty:
        assert problems[0].what == f"{key} is empty" and f"printf '%s' \"$T\" > {key}" in problems[0].fix
        with pytest.raises(ConfigError, match="is empty; fix: write the key into it") as err:
            validate_backend(cfg)
        assert err.value.key == "agents.mock.secret_env.T"
