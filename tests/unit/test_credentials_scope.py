"""daemon.credentials.scope: which sessions are GitHub-backed and what a lease may open
(LEASE-CTX-4: host and repository checked exactly)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from daemon.credentials.scope import (
    LeaseScope,
    github_scope_for_workspace,
    normalize_repository,
    parse_remote_url,
    workspace_origin_url,
)


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.mark.parametrize(
    "url",
    [
        "https://github.com/example/repo.git",
        "https://github.com/example/repo",
        "https://github.com/Example/Repo.git/",
        "https://user@github.com/example/repo.git",
        "https://github.com:443/example/repo.git",
        "git@github.com:example/repo.git",
        "ssh://git@github.com/example/repo.git",
        "ssh://git@github.com:22/example/repo",
        "github.com:example/repo",
    ],
)
def test_github_remote_forms(url: str) -> None:
    assert parse_remote_url(url) == LeaseScope("github.com", "example/repo")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "/srv/git/repo.git",
        "file:///srv/git/example/repo.git",
        "https://github.com:8443/example/repo.git",
        "https://github.com/example",
        "https://github.com/example/repo/tree/main",
        "https://github.com/../repo",
        "https://github.com/example/..",
        "https://github.com/example/.hidden",
        "ftp://github.com/example/repo",
    ],
)
def test_unrecognised_remotes(url: str) -> None:
    assert parse_remote_url(url) is None


def test_other_hosts_parse_but_are_not_github() -> None:
    assert parse_remote_url("https://gitlab.com/example/repo.git") == LeaseScope("gitlab.com", "example/repo")
    assert parse_remote_url("https://github.com.evil.example/example/repo.git").host == "github.com.evil.example"


def test_normalize_repository() -> None:
    assert normalize_repository("/Example/Repo.git/") == "example/repo"
    assert normalize_repository("example/repo.git/info/lfs") is None
    assert normalize_repository("example/repo.git/info/lfs", allow_lfs_suffix=True) == "example/repo"
    for bad in ("", "example", "a/b/c", "a//b", "../b", "a/..", "a/b c", "a/b\n"):
        assert normalize_repository(bad) is None, bad
    with pytest.raises(ValueError):
        LeaseScope.of("github.com", "not-a-repo")
    with pytest.raises(ValueError):
        LeaseScope.of("evil/host", "a/b")


def test_workspace_origin_of_repo_subdirectory_and_worktree(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", "-b", "main", cwd=repo)
    git("remote", "add", "origin", "git@github.com:Example/Repo.git", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x", cwd=repo)
    (repo / "sub").mkdir()
    wt = tmp_path / "wt"
    git("worktree", "add", "-q", "-b", "kandev/t", str(wt), cwd=repo)
    assert (wt / ".git").is_file()
    for ws in (repo, repo / "sub", wt):
        assert github_scope_for_workspace(ws) == LeaseScope("github.com", "example/repo"), ws
    git("remote", "set-url", "origin", "https://gitlab.com/example/repo.git", cwd=repo)
    assert workspace_origin_url(wt) == "https://gitlab.com/example/repo.git"
    assert github_scope_for_workspace(wt) is None


def test_workspace_without_origin_or_repository(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    assert github_scope_for_workspace(plain) is None
    assert github_scope_for_workspace(None) is None
    assert github_scope_for_workspace(tmp_path / "absent") is None
    assert github_scope_for_workspace("relative/path") is None
    git("init", "-q", cwd=plain)
    assert workspace_origin_url(plain) is None
