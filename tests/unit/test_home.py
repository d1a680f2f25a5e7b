"""daemon.host.home spells the home and its backend socket exactly as pathlib does (Issue 24 item 3).

The CLI resolves the home without pathlib (``daemon.host.home``); the daemons build ``Paths`` from the
same function. The reference here is the pathlib expression the home was resolved with before:
``Path(x).expanduser().absolute()``, ``Path(state).absolute()``, ``Path.home() / ...``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.host.home import backend_socket_path, resolve_home_dir
from daemon.host.paths import Paths, resolve_home

SPELLINGS = ["/srv/kandev", "//", "/srv//kandev/", "/srv/./kandev/.", "//srv/kandev", "///srv/kandev",
             "/srv/../kandev", "kandev", "./kandev", "a/./b//c/", "../up", "a/..", ".", "~", "~/k",
             "~root/k", "~root", "/", "/srv/kandev~", "-dash/x y", "/ü/ñ"]


@pytest.mark.parametrize("given", SPELLINGS)
def test_a_given_home_is_spelt_as_pathlib_spells_it(given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    reference = Path(given).expanduser().absolute()
    assert resolve_home_dir(given, {}) == str(reference)
    assert resolve_home_dir(None, {"KANDEV_HOME": given}) == str(reference)
    assert resolve_home(given, {}) == reference
    assert backend_socket_path(resolve_home_dir(given, {})) == str(reference / "run" / "backend.sock")
    assert str(Paths.for_home(resolve_home(given, {})).backend_socket) == str(reference / "run" / "backend.sock")


@pytest.mark.parametrize("state", ["/var/lib/kandev", "/var/lib/kandev:/var/lib/other", "rel/dir", "~/x"])
def test_the_state_directory_is_made_absolute_and_never_user_expanded(
        state: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_home_dir(None, {"STATE_DIRECTORY": state}) == str(Path(state.split(":")[0]).absolute())


def test_the_default_home_is_under_the_users_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert resolve_home_dir(None, {}) == str(Path.home() / ".local" / "share" / "kandev")
    monkeypatch.setenv("HOME", str(tmp_path / "h") + "//")
    assert resolve_home_dir(None, {}) == str(Path.home() / ".local" / "share" / "kandev")


def test_a_home_that_cannot_be_expanded_is_refused_as_pathlib_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    user = "no-such-user-" + os.urandom(4).hex()
    with pytest.raises(RuntimeError):
        Path(f"~{user}/k").expanduser()
    with pytest.raises(RuntimeError):
        resolve_home_dir(f"~{user}/k", {})
