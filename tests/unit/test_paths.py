"""daemon.host.paths: home resolution, directory modes, secret files, installation id."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from daemon.host.paths import (
    Paths,
    PathsError,
    SecretFileError,
    installation_id,
    read_secret_file,
    resolve_home,
    write_secret_file,
)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_resolve_home_precedence(tmp_path: Path) -> None:
    env = {"KANDEV_HOME": str(tmp_path / "k"), "STATE_DIRECTORY": f"{tmp_path}/s1:{tmp_path}/s2"}
    assert resolve_home(str(tmp_path / "cli"), env) == tmp_path / "cli"
    assert resolve_home(None, env) == tmp_path / "k"
    del env["KANDEV_HOME"]
    assert resolve_home(None, env) == tmp_path / "s1"
    assert resolve_home(None, {"HOME": "/nonexistent"}) == Path.home() / ".local/share/kandev"


def test_layout(tmp_path: Path) -> None:
    p = Paths.for_home(tmp_path)
    assert p.run_dir == tmp_path / "run"
    assert p.backend_socket == tmp_path / "run" / "backend.sock"
    assert p.db_path == tmp_path / "kandev.db"
    assert p.lock_path == tmp_path / "backend.lock"
    assert p.agentctl_log == tmp_path / "logs" / "agentctl.log"
    assert p.installation_id_path == tmp_path / "installation-id"


def test_ensure_creates_private_dirs_and_tightens(tmp_path: Path) -> None:
    home = tmp_path / "home"
    p = Paths.for_home(home)
    home.mkdir()
    (home / "secrets").mkdir(mode=0o755)
    os.chmod(home / "secrets", 0o755)
    p.ensure()
    for d in (p.run_dir, p.secrets_dir, p.agentctl_dir):
        assert _mode(d) == 0o700
    assert p.logs_dir.is_dir() and p.worktrees_dir.is_dir()
    p.ensure()  # idempotent


@pytest.mark.parametrize("name", ["run", "secrets"])
def test_ensure_refuses_symlinked_private_dir(tmp_path: Path, name: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (home / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PathsError, match="symlink"):
        Paths.for_home(home).ensure()


def test_new_socket_path_is_new_each_time(tmp_path: Path) -> None:
    p = Paths.for_home(tmp_path)
    a, b = p.new_agentctl_socket_path(), p.new_agentctl_socket_path()
    assert a != b and a.parent == p.run_dir
    assert a.name.startswith("agentctl-") and a.suffix == ".sock" and len(a.stem) == len("agentctl-") + 8


def test_socket_path_too_long_refused(tmp_path: Path) -> None:
    with pytest.raises(PathsError, match="longer than"):
        Paths.for_home(tmp_path / ("x" * 120)).new_agentctl_socket_path()


def test_secret_file_roundtrip(tmp_path: Path) -> None:
    f = tmp_path / "cred"
    write_secret_file(f, b"abc")
    assert _mode(f) == 0o600
    assert read_secret_file(f) == b"abc"
    write_secret_file(f, b"new")  # replaces atomically
    assert read_secret_file(f) == b"new"
    assert [x.name for x in tmp_path.iterdir()] == ["cred"]  # no temp file left


def test_read_secret_refuses_symlink_mode_missing(tmp_path: Path) -> None:
    f = tmp_path / "cred"
    write_secret_file(f, b"abc")
    link = tmp_path / "link"
    link.symlink_to(f)
    with pytest.raises(SecretFileError) as e:
        read_secret_file(link)
    assert e.value.reason == "symlink"
    os.chmod(f, 0o644)
    with pytest.raises(SecretFileError) as e:
        read_secret_file(f)
    assert e.value.reason == "bad_mode"
    with pytest.raises(SecretFileError) as e:
        read_secret_file(tmp_path / "absent")
    assert e.value.reason == "missing"
    (tmp_path / "dir").mkdir(mode=0o600)
    with pytest.raises(SecretFileError) as e:
        read_secret_file(tmp_path / "dir")
    assert e.value.reason == "not_regular"


def test_installation_id_created_once(tmp_path: Path) -> None:
    p = Paths.for_home(tmp_path)
    first = installation_id(p)
    assert len(first) == 32 and int(first, 16) >= 0
    assert _mode(p.installation_id_path) == 0o600
    assert installation_id(p) == first
    assert installation_id(Paths.for_home(tmp_path)) == first


def test_installation_id_malformed_is_an_error(tmp_path: Path) -> None:
    p = Paths.for_home(tmp_path)
    write_secret_file(p.installation_id_path, b"nope")
    with pytest.raises(SecretFileError) as e:
        installation_id(p)
    assert e.value.reason == "malformed"
    assert p.installation_id_path.read_bytes() == b"nope"  # never replaced
