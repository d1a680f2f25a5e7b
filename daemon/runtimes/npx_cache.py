"""npm's npx execution cache: the key of an exact spec, and the one repair kandev makes.

npm installs the packages an ``npx``/``npm exec`` run needs into
``<npm cache>/_npx/<key>``. libnpmexec (``lib/index.js``, checked against the
npm 11.19.1 installed with node 20) computes the key as::

    sha512(specs.map(resolveDirectorySpecs).sort(localeCompare 'en').join('\\n')).hex().slice(0, 16)

where each spec is the string as requested on the command line (``pkg@1.2.3``);
only *directory* specs are rewritten first, and kandev never uses those. Kandev
always runs exactly one registry spec, so the key is the first 16 hex digits of
sha512 of ``<package>@<version>``. Both ``npx <pkg>@<ver> ...`` (the launch) and
``npm exec --package=<pkg>@<ver> -- ...`` (the update) use that same key
(tests/integration/test_runtimes_npm.py checks it against a directory npm made).
Per NPM-CTX-5 the key is computed, never parsed from npm's output.

The repair (RESUME-11, RESUME-12) removes exactly ``<cache>/_npx/<key>`` of a built-in
package's exact spec and nothing else:

- the package must be one of the built-in managed npm packages and the version an
  exact release (no tags, ranges, paths, URLs or shell text);
- the cache root is what ``npm config get cache`` printed: an absolute, normalized
  path without ``..``, not ``/`` nor a top-level directory, and not a symlink;
- ``_npx`` and the entry are opened relative to the root's file descriptor without
  following symlinks; a symlink at either place is refused, and the entry's name must
  be a 16-hex-digit key, so nothing outside ``<cache>/_npx`` can be reached;
- the entry is removed with ``shutil.rmtree(dir_fd=...)``, which never follows a
  symlink inside it. The global cache is never cleaned.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.agents.registry import BUILTIN_AGENTS, EXACT_VERSION_RE, NPM_PACKAGE_RE

NPX_DIR = "_npx"
KEY_RE = re.compile(r"^[0-9a-f]{16}$")


class RepairRefused(Exception):
    """The repair would touch something it must not; nothing was deleted."""


def npx_key(spec: str) -> str:
    """The ``_npx`` directory name npm uses for a run of the one spec ``spec`` (``pkg@1.2.3``)."""
    if not isinstance(spec, str) or not spec or "\n" in spec:
        raise ValueError(f"not a single package spec: {spec!r}")
    return hashlib.sha512(spec.encode("utf-8")).hexdigest()[:16]


def trusted_spec(package: str, version: str) -> str:
    """``<package>@<version>`` when the package is a built-in managed npm package and the
    version an exact release; RepairRefused otherwise."""
    builtin = {a.package for a in BUILTIN_AGENTS.values() if a.runtime == "npm"}
    if not isinstance(package, str) or package not in builtin:
        raise RepairRefused(f"{package!r:.100} is not a built-in managed npm package")
    if not NPM_PACKAGE_RE.match(package) or ".." in package:  # built-in names are checked at import too
        raise RepairRefused(f"{package!r:.100} is not a plain npm package name")
    if not isinstance(version, str) or not EXACT_VERSION_RE.match(version):
        raise RepairRefused(f"{version!r:.100} is not an exact release version")
    return f"{package}@{version}"


def check_cache_root(text: str) -> Path:
    """The npm cache root npm reported, checked: RepairRefused when it is not one kandev may repair in."""
    raw = (text or "").strip()
    if not raw or "\n" in raw or "\0" in raw:
        raise RepairRefused(f"npm reported no usable cache directory: {raw[:200]!r}")
    if not os.path.isabs(raw):
        raise RepairRefused(f"npm cache {raw[:200]!r} is not an absolute path")
    if ".." in Path(raw).parts:
        raise RepairRefused(f"npm cache {raw[:200]!r} contains '..'")
    norm = os.path.normpath(raw)
    if norm.startswith("//"):
        norm = "/" + norm.lstrip("/")
    root = Path(norm)
    if len(root.parts) < 3:  # "/" or "/x": far too broad to repair anything in
        raise RepairRefused(f"npm cache {norm!r} is a broad root")
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return root
    if stat.S_ISLNK(st.st_mode):
        raise RepairRefused(f"npm cache {norm!r} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise RepairRefused(f"npm cache {norm!r} is not a directory")
    return root


def entry_path(cache_root: Path, spec: str) -> Path:
    """Where npm keeps the npx tree of ``spec`` (for reports; removal never uses this path)."""
    return Path(cache_root) / NPX_DIR / npx_key(spec)


@dataclass(frozen=True)
class RepairResult:
    path: str  # <cache>/_npx/<key>
    removed: bool  # False: there was nothing to remove


def remove_npx_entry(cache_root: Path | str, package: str, version: str) -> RepairResult:
    """Remove ``<cache_root>/_npx/<key of package@version>`` and nothing else (RESUME-12)."""
    spec = trusted_spec(package, version)
    root = check_cache_root(str(cache_root))
    key = npx_key(spec)
    return RepairResult(str(root / NPX_DIR / key), _remove_key(root, key))


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int | None:
    """An O_NOFOLLOW directory fd, None when absent; RepairRefused for a symlink or a non-directory."""
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RepairRefused(f"{name} is a symlink or not a directory") from None
        raise


def _remove_key(root: Path, key: str) -> bool:
    """Remove ``root/_npx/key``; True when it existed. ``key`` must be a 16-hex-digit npx key."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise RepairRefused(f"{key!r:.100} is not an npx cache key")
    root_fd = _open_dir(root)
    if root_fd is None:
        return False
    try:
        npx_fd = _open_dir(NPX_DIR, dir_fd=root_fd)
        if npx_fd is None:
            return False
        try:
            try:
                st = os.stat(key, dir_fd=npx_fd, follow_symlinks=False)
            except FileNotFoundError:
                return False
            if stat.S_ISLNK(st.st_mode):
                raise RepairRefused(f"{root / NPX_DIR / key} is a symlink")
            if not stat.S_ISDIR(st.st_mode):
                raise RepairRefused(f"{root / NPX_DIR / key} is not a directory")
            shutil.rmtree(key, dir_fd=npx_fd)  # fd-based: never follows a symlink inside the tree
            return True
        finally:
            os.close(npx_fd)
    finally:
        os.close(root_fd)
