"""The ``[credentials]`` settings: ``github_token_file`` (a path, never the token) and
``lease_ttl`` (default 1h, accepted 1min..24h, rejected otherwise naming key, value and range)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import settings as cfg
from daemon.config.keys import ConfigError
from daemon.config.settings import CredentialsConfig, load_config, validate_backend


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kandev.toml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    c = load_config(None, {})
    assert c.credentials == CredentialsConfig(github_token_file=None, lease_ttl=3600.0)
    validate_backend(c)


@pytest.mark.parametrize(("text", "seconds"), [("1min", 60.0), ("60s", 60.0), ("90min", 5400.0), ("24h", 86400.0)])
def test_lease_ttl_accepted(tmp_path: Path, text: str, seconds: float) -> None:
    c = load_config(_file(tmp_path, f'[credentials]\nlease_ttl = "{text}"\n'), {})
    validate_backend(c)
    assert c.credentials.lease_ttl == seconds


@pytest.mark.parametrize("text", ["59s", "500ms", "0s", "-1h", "1441min", "25h"])
def test_lease_ttl_out_of_range_is_rejected_not_clamped(tmp_path: Path, text: str) -> None:
    c = load_config(_file(tmp_path, f'[credentials]\nlease_ttl = "{text}"\n'), {})
    with pytest.raises(ConfigError) as err:
        validate_backend(c)
    msg = str(err.value)
    assert err.value.key == "credentials.lease_ttl"
    assert f'credentials.lease_ttl (in {tmp_path / "kandev.toml"}) = "{text}" is out of range' in msg
    assert "1min..24h" in msg


def test_lease_ttl_from_the_environment(tmp_path: Path) -> None:
    c = load_config(None, {"KANDEV_CREDENTIALS_LEASE_TTL": "2h"})
    assert c.credentials.lease_ttl == 7200.0
    with pytest.raises(ConfigError) as err:
        validate_backend(load_config(None, {"KANDEV_CREDENTIALS_LEASE_TTL": "30s"}))
    assert err.value.env_var == "KANDEV_CREDENTIALS_LEASE_TTL" and "1min..24h" in str(err.value)
    with pytest.raises(ConfigError, match="not a duration"):
        load_config(None, {"KANDEV_CREDENTIALS_LEASE_TTL": "3600"})


def test_github_token_file_is_a_path(tmp_path: Path) -> None:
    c = load_config(_file(tmp_path, '[credentials]\ngithub_token_file = "/etc/kandev/github-token"\n'), {})
    validate_backend(c)
    assert c.credentials.github_token_file == "/etc/kandev/github-token"
    c = load_config(None, {"KANDEV_CREDENTIALS_GITHUB_TOKEN_FILE": "relative/token"})
    with pytest.raises(ConfigError) as err:
        validate_backend(c)
    assert err.value.key == "credentials.github_token_file" and "absolute path" in str(err.value)
    with pytest.raises(ConfigError, match="non-empty"):
        load_config(_file(tmp_path, '[credentials]\ngithub_token_file = ""\n'), {})


def test_unknown_credentials_keys_are_refused(tmp_path: Path) -> None:
    """There is no key for the token itself: it never goes into configuration or the environment."""
    with pytest.raises(ConfigError, match="unknown setting credentials.github_token "):
        load_config(_file(tmp_path, '[credentials]\ngithub_token = "ghp_x"\n'), {})
    with pytest.raises(ConfigError, match="KANDEV_CREDENTIALS_GITHUB_TOKEN"):
        load_config(None, {"KANDEV_CREDENTIALS_GITHUB_TOKEN": "ghp_x"})
