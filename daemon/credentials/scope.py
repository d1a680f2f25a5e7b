"""What a lease may open: one host and one repository, and how the live state names them.

A session is **GitHub-backed** when its task's workspace is a git repository whose ``origin``
remote is on github.com (``https://github.com/o/r.git``, ``git@github.com:o/r.git``,
``ssh://git@github.com/o/r``...). Repositories are compared as ``owner/name`` in lower case
without ``.git`` (GitHub's names are case-insensitive).

The origin is read without running anything the repository controls: the git directory is found
by walking up from the workspace (``.git`` directory, or ``.git`` file of a worktree plus its
``commondir``) and only that config file is read, with ``git config --file`` (direct argv, no
repository discovery, no hooks, no ``safe.directory`` ownership check).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

GITHUB_HOST = "github.com"
_SEGMENT = re.compile(r"^[A-Za-z0-9._-]{1,100}$")
_SCP = re.compile(r"^(?:[^@/:]+@)?(?P<host>[^@/:]+):(?P<path>[^/].*)$")
_DEFAULT_PORTS = {"https": 443, "http": 80, "ssh": 22, "git": 9418}
_GIT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LeaseScope:
    """A host and an ``owner/name`` repository on it, normalized."""

    host: str
    repository: str

    @classmethod
    def of(cls, host: str, repository: str) -> LeaseScope:
        """Normalize; ``ValueError`` for a host or repository that is not one."""
        h = host.strip().lower()
        if not h or any(c in h for c in "/@: \t\n"):
            raise ValueError(f"not a host name: {host!r:.100}")
        repo = normalize_repository(repository)
        if repo is None:
            raise ValueError(f"not an owner/name repository: {repository!r:.200}")
        return cls(h, repo)

    def __str__(self) -> str:
        return f"{self.host}/{self.repository}"


def normalize_repository(text: str, *, allow_lfs_suffix: bool = False) -> str | None:
    """``"/Owner/Repo.git/"`` -> ``"owner/repo"``; None if it is not exactly one repository.

    With ``allow_lfs_suffix`` a trailing ``info/lfs`` (git-lfs asks for ``o/r.git/info/lfs``) is
    accepted and dropped.
    """
    parts = text.strip("/").split("/")
    if allow_lfs_suffix and len(parts) == 4 and parts[2:] == ["info", "lfs"]:
        parts = parts[:2]
    if len(parts) != 2:
        return None
    owner, name = parts
    if name.lower().endswith(".git"):
        name = name[:-4]
    for seg in (owner, name):
        if not _SEGMENT.fullmatch(seg) or seg in (".", "..") or seg.startswith("."):
            return None
    return f"{owner}/{name}".lower()


def parse_remote_url(url: str) -> LeaseScope | None:
    """The (host, repository) a remote URL names, or None when it is not a recognised form."""
    u = url.strip()
    if not u:
        return None
    if "://" in u:
        try:
            parts = urlsplit(u)
            port = parts.port
        except ValueError:
            return None
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            return None
        if port is not None and port != _DEFAULT_PORTS[scheme]:
            return None  # github.com on another port is not GitHub
        host, path = parts.hostname, parts.path
    else:
        m = _SCP.match(u)
        if m is None:
            return None
        host, path = m.group("host"), m.group("path")
    repo = normalize_repository(path)
    if repo is None:
        return None
    return LeaseScope(host.lower(), repo)


def _git_dir(start: Path) -> Path | None:
    for d in (start, *start.parents):
        dotgit = d / ".git"
        try:
            if dotgit.is_dir():
                gitdir = dotgit
            elif dotgit.is_file():
                text = dotgit.read_text(errors="replace").strip()
                if not text.startswith("gitdir:"):
                    return None
                gitdir = Path(text[len("gitdir:"):].strip())
                if not gitdir.is_absolute():
                    gitdir = d / gitdir
            else:
                continue
            common = gitdir / "commondir"
            if common.is_file():
                rel = Path(common.read_text(errors="replace").strip())
                gitdir = rel if rel.is_absolute() else gitdir / rel
            return gitdir
        except OSError:
            return None
    return None


def workspace_origin_url(workspace: str | os.PathLike[str]) -> str | None:
    """``remote.origin.url`` of the repository holding ``workspace``, or None."""
    path = Path(workspace)
    if not path.is_absolute() or not path.is_dir():
        return None
    gitdir = _git_dir(path)
    if gitdir is None or not (gitdir / "config").is_file():
        return None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent",
           "LC_ALL": "C"}
    try:
        proc = subprocess.run(
            ["git", "config", "--file", str(gitdir / "config"), "--get", "remote.origin.url"],
            capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def github_scope(url: str | None, hosts: tuple[str, ...] = (GITHUB_HOST,)) -> LeaseScope | None:
    """The GitHub scope a remote URL names when its host is one of ``hosts``, else None."""
    scope = parse_remote_url(url) if url else None
    return scope if scope is not None and scope.host in hosts else None


def github_scope_for_workspace(workspace: str | os.PathLike[str] | None,
                               hosts: tuple[str, ...] = (GITHUB_HOST,)) -> LeaseScope | None:
    """The workspace's GitHub scope when it is GitHub-backed, else None."""
    if not workspace:
        return None
    return github_scope(workspace_origin_url(workspace), hosts)
