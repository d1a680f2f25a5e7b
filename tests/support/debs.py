"""Building kandev's Debian packages for the package tests (host side), cached.

``build_packages()`` builds the .deb of the current sources once per content of what goes into
it (daemon/, ipc/, debian/, docs/, packaging/, units/, README.md, pyproject.toml) by
``dpkg-buildpackage -us -uc -b`` in a copy of the checkout under /var/tmp, together with a rebuild
whose debian/changelog and daemon/core/version.py carry a higher version (the upgrade: its code reports
that version) and the lintian report; the three are cached in /var/tmp/kandev-deb-cache/<hash>/.
``build_release_package(release)`` builds the .deb of an earlier release from a clone of its
commit (``tests/support/releases.py``), cached in /var/tmp/kandev-deb-cache/release-<commit>/.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.releases import Release, release_tree

CACHE = Path("/var/tmp/kandev-deb-cache")
SOURCES = ("daemon", "ipc", "debian", "docs", "packaging", "units", "README.md", "pyproject.toml")
BUILD_TIMEOUT = 600

def _skip(name: str) -> bool:
    return name in ("__pycache__", ".ruff_cache") or name.endswith((".pyc", ".egg-info"))


def source_hash() -> str:
    """sha256 over path, mode and content of every file the package is built from."""
    h = hashlib.sha256()
    for top in SOURCES:
        root = REPO_ROOT / top
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if (p.is_file() or p.is_symlink()) and not any(_skip(x) for x in p.parts)
        )
        for f in files:
            rel = f.relative_to(REPO_ROOT).as_posix()
            data = os.readlink(f).encode() if f.is_symlink() else f.read_bytes()
            h.update(f"{rel}\0{f.lstat().st_mode:o}\0{len(data)}\0".encode() + data)
    return h.hexdigest()[:16]


def _version() -> str:
    first = (REPO_ROOT / "debian/changelog").read_text().splitlines()[0]
    m = re.match(r"^kandev \(([^)]+)\)", first)
    assert m, first
    return m.group(1)


def _arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


# The packages the tests build are installed once and thrown away: dpkg-deb compresses them with xz
# level 1 instead of its default 6 (dpkg >= 1.21.10 reads these variables). The same xz format, ~20%
# larger, and ~1.5 s instead of ~17 s of one CPU per build, two builds per change of the sources. The
# release build (debian/rules) keeps dpkg's default.
_TEST_BUILD_ENV = {"DPKG_DEB_COMPRESSOR_TYPE": "xz", "DPKG_DEB_COMPRESSOR_LEVEL": "1"}


def _dpkg_buildpackage(tree: Path, log: Path) -> float:
    t0 = time.monotonic()
    with open(log, "ab") as out:
        p = subprocess.run(["dpkg-buildpackage", "-us", "-uc", "-b"], cwd=tree, stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT, check=False,
                           env={**os.environ, **_TEST_BUILD_ENV})
    if p.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        pytest.fail(f"dpkg-buildpackage failed ({p.returncode}) in {tree}:\n{tail}", pytrace=False)
    return time.monotonic() - t0


def build_packages() -> dict[str, Any]:
    """The cached build for the current sources: {deb, upgrade_deb, version, upgrade_version, lintian, ...}."""
    _check_tools()
    digest, version = source_hash(), _version()
    upgrade = f"{version}+test1"
    arch = _arch()
    CACHE.mkdir(parents=True, exist_ok=True)
    entry = CACHE / digest
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a waiting run then finds the cache
        if not (entry / "meta.json").exists():
            work = Path(tempfile.mkdtemp(prefix=f"kandev-deb-{digest}-", dir="/var/tmp"))
            try:
                tree = work / f"kandev-{version}"
                tree.mkdir()
                for top in SOURCES:
                    src = REPO_ROOT / top
                    if src.is_dir():
                        shutil.copytree(src, tree / top, symlinks=True,
                                        ignore=lambda d, names: [n for n in names if _skip(n)])
                    else:
                        shutil.copy2(src, tree / top)
                log = work / "build.log"
                seconds = _dpkg_buildpackage(tree, log)
                lint = subprocess.run(["lintian", "--pedantic", f"kandev_{version}_{arch}.deb"], cwd=work,
                                      capture_output=True, text=True, timeout=300, check=False)
                changelog = tree / "debian/changelog"
                version_py = tree / "daemon/core/version.py"  # the upgrade's code says its version too
                version_py.write_text(version_py.read_text().replace(f'VERSION = "{version}"', f'VERSION = "{upgrade}"'))
                changelog.write_text(
                    f"kandev ({upgrade}) bookworm; urgency=medium\n\n"
                    "  * Rebuild with a higher version (tests/systemd/test_package.py upgrade test).\n\n"
                    f" -- Kandev maintainers <maintainers@kandev.example>  {formatdate()}\n\n"
                    + changelog.read_text()
                )
                seconds_upgrade = _dpkg_buildpackage(tree, log)
                staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=CACHE))
                for v in (version, upgrade):
                    shutil.copy2(work / f"kandev_{v}_{arch}.deb", staging)
                (staging / "lintian.txt").write_text(lint.stdout + lint.stderr)
                (staging / "meta.json").write_text(json.dumps({
                    "hash": digest, "version": version, "upgrade_version": upgrade, "arch": arch,
                    "build_seconds": round(seconds, 1), "rebuild_seconds": round(seconds_upgrade, 1),
                    "lintian_rc": lint.returncode,
                }))
                shutil.rmtree(entry, ignore_errors=True)
                staging.rename(entry)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            # keep the three newest builds
            old = sorted((d for d in CACHE.iterdir() if d.is_dir() and not d.name.startswith((".", "release-"))),
                         key=lambda d: d.stat().st_mtime, reverse=True)[3:]
            for d in old:
                shutil.rmtree(d, ignore_errors=True)
    meta = json.loads((entry / "meta.json").read_text())
    meta["deb"] = entry / f"kandev_{version}_{arch}.deb"
    meta["upgrade_deb"] = entry / f"kandev_{upgrade}_{arch}.deb"
    meta["lintian"] = (entry / "lintian.txt").read_text()
    return meta


def _check_tools() -> None:
    for tool in ("dpkg-buildpackage", "dh", "dh_python3", "lintian"):
        if shutil.which(tool) is None:
            why = f"{tool} not found: run `bash packaging/dev/setup.sh` on Debian 12 (it installs the build tools)"
            if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
                pytest.fail(why, pytrace=False)  # CI must never skip the package tests
            pytest.skip(why)


def build_release_package(release: Release) -> Path:
    """The .deb of an earlier release, built from a clone of its commit (cached)."""
    _check_tools()
    arch = _arch()
    entry = CACHE / f"release-{release.commit}"
    deb = entry / f"kandev_{release.version}_{arch}.deb"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not deb.exists():
            source = release_tree(release)
            work = Path(tempfile.mkdtemp(prefix=f"kandev-deb-{release.version}-", dir="/var/tmp"))
            try:
                tree = work / f"kandev-{release.version}"
                shutil.copytree(source, tree, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
                _dpkg_buildpackage(tree, work / "build.log")
                staging = Path(tempfile.mkdtemp(prefix=f".release-{release.commit}-", dir=CACHE))
                shutil.copy2(work / deb.name, staging)
                shutil.rmtree(entry, ignore_errors=True)
                staging.rename(entry)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return deb
