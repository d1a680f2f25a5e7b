"""One version everywhere: daemon/core/version.py, pyproject.toml, debian/changelog, the man pages,
and the release record (packaging/releases.txt) for every earlier version (Issue 15 item 5)."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from daemon.core import version
from daemon.core.version import VERSION, installed_version, version_key
from tests.support.paths import REPO_ROOT


def test_pyproject_reads_the_version_from_daemon_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "daemon.core.version.VERSION"}


def test_debian_changelog_and_man_pages_are_in_step() -> None:
    first = (REPO_ROOT / "debian/changelog").read_text().splitlines()[0]
    assert first.startswith(f"kandev ({VERSION}) "), first
    for page in sorted((REPO_ROOT / "packaging/man").glob("*.[18]")):
        assert f'"kandev {VERSION}"' in page.read_text().splitlines()[0], page


def test_every_earlier_changelog_version_has_a_release_record() -> None:
    changelog = (REPO_ROOT / "debian/changelog").read_text()
    versions = re.findall(r"^kandev \(([^)]+)\)", changelog, re.MULTILINE)
    records = dict(
        line.split() for line in (REPO_ROOT / "packaging/releases.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    for earlier in versions[1:]:
        assert re.fullmatch(r"[0-9a-f]{40}", records.get(earlier, "")), f"no commit recorded for {earlier}"
    assert version_key(versions[0]) > max(version_key(v) for v in records)


def test_recorded_release_commits_match_their_tags_when_the_clone_has_them() -> None:
    lines = (REPO_ROOT / "packaging/releases.txt").read_text().splitlines()
    for line in lines:
        if not line.strip() or line.startswith("#"):
            continue
        ver, commit = line.split()
        tag = subprocess.run(["git", "rev-parse", "--verify", "-q", f"v{ver}^{{commit}}"], cwd=REPO_ROOT,
                             capture_output=True, text=True)
        if tag.returncode == 0:  # a clone without tags has only the record
            assert tag.stdout.strip() == commit, f"v{ver} is {tag.stdout.strip()}, the record says {commit}"


def test_installed_version_reads_the_file_not_the_import(tmp_path: Path) -> None:
    assert installed_version() == VERSION
    newer = tmp_path / "version.py"
    newer.write_text(Path(version.__file__).read_text().replace(f'VERSION = "{VERSION}"', 'VERSION = "9.8.7"'))
    assert installed_version(newer) == "9.8.7"
    assert installed_version(tmp_path / "missing.py") is None
    assert version_key("0.2.0+test1") == (0, 2, 0) < version_key("0.10.0")
