"""The cluster's settings (Issue 47): cluster.host only with PostgreSQL and as a host name,
cluster.host_timeout_s at least three heartbeats, database.password_file checked like a secret_env
file and read at connect time (a file, or a systemd credential), never repeated in a message."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.config import settings as cfg
from daemon.config.database import connect_args, database_password
from daemon.config.keys import ConfigError
from daemon.config.settings import load_config, validate_backend

PG = "postgresql+psycopg://kandev@/kandev?host=/run/postgresql"


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")


def _refused(env: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate_backend(load_config(None, env))
    return err.value


@pytest.mark.parametrize(("env", "key", "words"), [
    ({"KANDEV_CLUSTER_HOST": "b"}, "cluster.host", "needs a PostgreSQL database.url"),
    ({"KANDEV_CLUSTER_HOST": "b_1", "KANDEV_DATABASE_URL": PG}, "cluster.host", '"b_1" is not a host name'),
    ({"KANDEV_CLUSTER_HOST": "x" * 64, "KANDEV_DATABASE_URL": PG}, "cluster.host", "is not a host name"),
    ({"KANDEV_CLUSTER_HEARTBEAT_S": "61"}, "cluster.heartbeat_s", '"61" is out of range: accepted 1..60'),
    ({"KANDEV_CLUSTER_HOST_TIMEOUT_S": "601"}, "cluster.host_timeout_s", '"601" is out of range'),
    ({"KANDEV_CLUSTER_HEARTBEAT_S": "20"}, "cluster.host_timeout_s", "= 30 is less than 3 heartbeats"),
    ({"KANDEV_DATABASE_PASSWORD_FILE": "db-password"}, "database.password_file", "is not an absolute path"),
    ({"KANDEV_DATABASE_PASSWORD_FILE": "/nonexistent/pw"}, "database.password_file", "does not exist"),
])
def test_cluster_settings_out_of_range_are_refused_naming_key_and_value(env, key, words) -> None:
    """Issue 47 item 1, Issue 47 item 4: refused at start, naming the key, the value and the range."""
    err = _refused(env)
    assert err.key == key and key in str(err) and words in str(err), str(err)


def test_a_cluster_host_with_postgresql_is_accepted() -> None:
    config = load_config(None, {"KANDEV_CLUSTER_HOST": "build-3", "KANDEV_DATABASE_URL": PG,
                                "KANDEV_CLUSTER_HEARTBEAT_S": "10"})
    validate_backend(config)
    assert (config.cluster.host, config.cluster.heartbeat_s, config.cluster.host_timeout_s) == ("build-3", 10, 30)


def test_the_password_file_is_checked_like_a_key_file_and_never_repeated(tmp_path: Path) -> None:
    """Issue 47 item 6: a file readable by others is refused with the fix; the password read is the
    file's first line without its line break; no message holds it."""
    secret = tmp_path / "db-password"
    secret.write_text("s3cret-pw\n")
    secret.chmod(0o644)
    err = _refused({"KANDEV_DATABASE_PASSWORD_FILE": str(secret)})
    assert "mode" in str(err) and "s3cret" not in str(err), str(err)
    secret.chmod(0o600)
    config = load_config(None, {"KANDEV_DATABASE_PASSWORD_FILE": str(secret), "KANDEV_DATABASE_URL": PG})
    validate_backend(config)
    assert database_password(config) == "s3cret-pw"
    assert connect_args(config) == {"password": "s3cret-pw"}
    assert connect_args(load_config(None, {})) == {}
    secret.write_text("")
    with pytest.raises(ConfigError, match="database.password_file") as empty:
        database_password(config)
    assert "empty" in str(empty.value)


def test_the_password_from_a_systemd_credential(tmp_path: Path) -> None:
    """``credential:NAME``: read from $CREDENTIALS_DIRECTORY/NAME (LoadCredential= of the backend's
    unit); without that directory the refusal says which drop-in line gives it."""
    config = load_config(None, {"KANDEV_DATABASE_PASSWORD_FILE": "credential:kandev-db", "KANDEV_DATABASE_URL": PG})
    validate_backend(config)  # a credential is only there at the service's start
    with pytest.raises(ConfigError, match="LoadCredential=kandev-db:"):
        database_password(config, {})
    creds = tmp_path / "creds"
    creds.mkdir()
    fd = os.open(creds / "kandev-db", os.O_WRONLY | os.O_CREAT, 0o400)
    os.write(fd, b"from-systemd")
    os.close(fd)
    assert database_password(config, {"CREDENTIALS_DIRECTORY": str(creds)}) == "from-systemd"
