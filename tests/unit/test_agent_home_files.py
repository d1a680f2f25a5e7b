"""``[agents.NAME] home_files`` (Issue 22 item 1): the setting's checks at start, and the copy
into a session's HOME that never follows a symlink the agent planted there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from daemon.agents import home_files
from daemon.agents.settings import describe
from daemon.config.keys import ConfigError
from daemon.config.settings import load_config, validate_backend


def _file(path: Path, text: str = '{"ok": true}\n', mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _load(tmp_path: Path, table: str) -> object:
    p = tmp_path / "kandev.toml"
    p.write_text(f"[agents.opencode]\nhome_files = {table}\n")
    return load_config(str(p), env={})


def test_home_files_parse_check_and_show_destinations_only(tmp_path: Path) -> None:
    src = _file(tmp_path / "opencode.json", '{"apiKey": "SECRET-CONTENT"}')
    cfg = _load(tmp_path, f'{{ ".config/opencode/opencode.json" = "{src}" }}')
    validate_backend(cfg)  # type: ignore[arg-type]
    shown = describe(cfg.agents.settings, "opencode")  # type: ignore[attr-defined]
    assert shown["home_files"] == {".config/opencode/opencode.json": str(src)}
    assert "SECRET-CONTENT" not in repr(shown) and "SECRET-CONTENT" not in repr(cfg)


@pytest.mark.parametrize("dest, words", [
    ("/etc/passwd", "plain relative path"), ("../x", "plain relative path"), ("a//b", "plain relative path"),
    ("a/./b", "plain relative path"), ("", "relative to the session's HOME"),
])
def test_bad_destinations_are_refused_naming_the_key(tmp_path: Path, dest: str, words: str) -> None:
    src = _file(tmp_path / "f")
    with pytest.raises(ConfigError, match=words) as err:
        _load(tmp_path, f'{{ "{dest}" = "{src}" }}')
    assert err.value.key.startswith("agents.opencode.home_files")


@pytest.mark.parametrize("make, words", [
    (lambda p: p, "does not exist"),
    (lambda p: _file(p, mode=0o644), "mode 0644"),
    (lambda p: (p.with_name("real").write_text("x"), p.with_name("real").chmod(0o600), p.symlink_to(p.with_name("real")))
     and p, "symlink"),
])
def test_sources_are_checked_at_start_like_secret_files(tmp_path: Path, make: object, words: str) -> None:
    src = tmp_path / "src"
    make(src)  # type: ignore[operator]
    cfg = _load(tmp_path, f'{{ ".codex/config.toml" = "{src}" }}')
    with pytest.raises(ConfigError, match=words) as err:
        validate_backend(cfg)  # type: ignore[arg-type]
    assert err.value.key == "agents.opencode.home_files..codex/config.toml"


def test_relative_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="absolute") as err:
        _load(tmp_path, '{ "a" = "relative/file" }')
    assert err.value.key == "agents.opencode.home_files.a"


def test_install_writes_0600_with_parents_owned_like_the_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    src = _file(tmp_path / "settings.json", '{"a": 1}', mode=0o640)
    assert home_files.install(home, "gemini", {".gemini/settings.json": str(src)}) == [".gemini/settings.json"]
    dest = home / ".gemini" / "settings.json"
    assert dest.read_text() == '{"a": 1}'
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert stat.S_IMODE((home / ".gemini").stat().st_mode) == 0o700
    assert dest.stat().st_uid == home.stat().st_uid
    src.chmod(0o600)
    _file(src, '{"a": 2}')
    home_files.install(home, "gemini", {".gemini/settings.json": str(src)})  # every launch: copied again
    assert dest.read_text() == '{"a": 2}'
    assert [p.name for p in (home / ".gemini").iterdir()] == ["settings.json"]  # no temporary file left


def test_install_gives_the_copies_to_the_homes_owner(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the HOME another owner")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chown(home, 4242, 4343)
    src = _file(tmp_path / "config.toml")
    home_files.install(home, "codex", {".codex/config.toml": str(src)})
    for p in (home / ".codex", home / ".codex" / "config.toml"):
        assert (p.stat().st_uid, p.stat().st_gid) == (4242, 4343)


def test_a_planted_symlink_is_never_followed(tmp_path: Path) -> None:
    """The agent owns its HOME: a symlinked directory on the way is refused naming the key; a
    symlink at the destination is replaced, its target untouched."""
    home, outside = tmp_path / "home", tmp_path / "outside"
    home.mkdir(mode=0o700)
    outside.mkdir()
    victim = _file(outside / "victim", "keep me")
    src = _file(tmp_path / "f", "new content")
    (home / ".config").symlink_to(outside)
    with pytest.raises(home_files.HomeFileError, match="symlink") as err:
        home_files.install(home, "opencode", {".config/victim": str(src)})
    assert err.value.key == "agents.opencode.home_files..config/victim"
    assert victim.read_text() == "keep me" and sorted(p.name for p in outside.iterdir()) == ["victim"]

    (home / "settings.json").symlink_to(victim)
    home_files.install(home, "opencode", {"settings.json": str(src)})
    assert victim.read_text() == "keep me"
    assert not (home / "settings.json").is_symlink() and (home / "settings.json").read_text() == "new content"


def test_a_directory_at_the_destination_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "settings.json").mkdir(parents=True)
    src = _file(tmp_path / "f")
    with pytest.raises(home_files.HomeFileError, match="settings.json"):
        home_files.install(home, "gemini", {"settings.json": str(src)})
