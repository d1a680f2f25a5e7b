"""The previous release, built from this repository's history, for version-skew tests (Issue 15).

``previous_release()`` is the newest release older than ``daemon.core.version.VERSION`` (and
``recorded_release(version)`` any recorded one): its commit is
the tag ``v<version>`` when this clone has it, else the record in ``packaging/releases.txt`` (CI
clones may lack tags). A commit this clone does not have is a test failure with the fix, never a
skip. ``release_tree(commit)`` is a ``git clone`` of this repository checked out at that commit,
and ``release_venv(commit)`` a virtual environment with that tree installed (``pip install``, its
own pinned dependencies from PyPI); both are cached under ``/var/tmp/kandev-release-cache/<commit>``
(not /tmp: the systemd sandbox sees /var/tmp) and built once, under a lock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.core.version import VERSION, version_key
from tests.support.paths import REPO_ROOT

CACHE = Path("/var/tmp/kandev-release-cache")
RECORD = REPO_ROOT / "packaging" / "releases.txt"
BUILD_TIMEOUT = 900


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    source: str  # "tag" | "record"


def _git(*args: str, cwd: Path = REPO_ROOT, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=check)


def _records() -> dict[str, str]:
    records = {}
    for line in RECORD.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            ver, commit = line.split()
            records[ver] = commit
    return records


def previous_release() -> Release:
    records = _records()
    older = sorted((v for v in records if version_key(v) < version_key(VERSION)), key=version_key)
    if not older:
        pytest.fail(f"packaging/releases.txt records no release older than {VERSION}", pytrace=False)
    return recorded_release(older[-1])


def recorded_release(version: str) -> Release:
    """The release ``version`` recorded in packaging/releases.txt (packaging/dev/piuparts.sh names one)."""
    records = _records()
    if version not in records:
        pytest.fail(f"packaging/releases.txt records no release {version!r} (it records {', '.join(records)})",
                    pytrace=False)
    tag = _git("rev-parse", "--verify", "-q", f"v{version}^{{commit}}", check=False)
    if tag.returncode == 0:
        commit = tag.stdout.strip()
        if commit != records[version]:
            pytest.fail(f"tag v{version} is {commit}, packaging/releases.txt says {records[version]}", pytrace=False)
        return Release(version, commit, "tag")
    commit = records[version]
    if _git("cat-file", "-e", f"{commit}^{{commit}}", check=False).returncode != 0:
        pytest.fail(f"release {version} ({commit}) is not in this clone (no tag v{version}, commit absent): "
                    f"fetch it, e.g. `git fetch --unshallow` or `git fetch origin tag v{version}`", pytrace=False)
    return Release(version, commit, "record")


@contextmanager
def _locked(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def release_tree(release: Release) -> Path:
    """A clone of this repository at the release's commit (cached)."""
    entry = CACHE / release.commit
    tree = entry / "src"
    with _locked(release.commit):
        if not (tree / ".kandev-release-ok").exists():
            entry.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix="src-", dir=entry))
            try:
                _git("clone", "--quiet", "--no-checkout", str(REPO_ROOT), str(work))
                _git("-c", "advice.detachedHead=false", "checkout", "--quiet", release.commit, cwd=work)
                (work / ".kandev-release-ok").write_text(f"{release.version} {release.commit}\n")
                shutil.rmtree(tree, ignore_errors=True)
                work.rename(tree)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return tree


def release_venv(release: Release) -> Path:
    """A virtual environment with the release installed from its tree (cached); returns its python."""
    tree = release_tree(release)
    venv = CACHE / release.commit / "venv"
    python = venv / "bin" / "python"
    with _locked(release.commit):
        if not (venv / ".kandev-release-ok").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=BUILD_TIMEOUT)
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
            p = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                str(tree)], capture_output=True, text=True, timeout=BUILD_TIMEOUT, env=env)
            if p.returncode:
                pytest.fail(f"pip install of release {release.version} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}",
                            pytrace=False)
            (venv / ".kandev-release-ok").write_text(f"{release.version} {release.commit}\n")
        _link_seccomp(python)
    return python


def _link_seccomp(python: Path) -> None:
    """What packaging/dev/setup.sh does for the dev venv: libseccomp's Python bindings are not on PyPI,
    so a venv sees Debian's python3-seccomp module through a link (0.3.0 and later filter every
    agent's system calls with it; an older release never imports it)."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    for module in Path("/usr/lib/python3/dist-packages").glob("seccomp.cpython-*.so"):
        link = Path(site) / module.name
        if not link.exists() and not link.is_symlink():
            link.symlink_to(module)
