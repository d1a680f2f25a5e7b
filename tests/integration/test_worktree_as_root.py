"""Worktrees as root (Issue 45 item 4; Issue 45 scenario D): kandev running as root, its agents as
``kandev-agent``, on a repository that root owns.

- shared with every uid (``chmod -R a+rwX``, as shared build checkouts are): ``task create
  --executor worktree`` works, and an agent commits on its branch; what kandev gives the agents' uid
  in the repository is exactly the new worktree's admin directory and its branch's ref and reflog
  directories (nothing else changes owner or mode);
- shared, but its checkout fails (a required smudge filter that fails): refused with git's message,
  and nothing is left behind, in the repository (no ``worktrees/``, no branch) or the home;
- not shared (root's default modes), or shared but for its ``objects``: refused before anything is
  created, with a message that says how to share the repository; nothing of it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.hostile_workspaces import GIT, agent_said, repository_script
from tests.support.kandev import Kandev
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="agents keep our own uid when kandev is not root")]

Entry = tuple[str, int, int, int, str]  # kind, mode, uid, gid, content digest


def _snapshot(root: Path) -> dict[str, Entry]:
    """Every entry below ``root`` (``root`` included as "."): kind, mode, owner and content, never
    following a symlink."""
    out: dict[str, Entry] = {}
    for d, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if d == str(root) else [*dirs, *files]:
            p = os.path.normpath(os.path.join(d, name))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                kind, digest = "link", os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                kind, digest = "dir", ""
            else:
                kind, digest = "file", hashlib.sha256(Path(p).read_bytes()).hexdigest()
            out[os.path.relpath(p, root)] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, digest)
    return out


def _repository(path: Path, *, shared: bool) -> Path:
    """A repository root owns (root's umask: 022 here, whatever the daemon's), shared with every
    uid when ``shared`` (``chmod -R a+rwX``)."""
    subprocess.run(["sh", "-c", "umask 022 && " + repository_script(str(path))], check=True, capture_output=True,
                   timeout=60)
    if shared:
        subprocess.run(["chmod", "-R", "a+rwX", str(path)], check=True, timeout=60)
    return path


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=repo, check=True, capture_output=True, text=True, timeout=60).stdout


def _create(k: Kandev, repo: Path) -> subprocess.CompletedProcess[str]:
    return k.run("task", "create", "--title", "as root", "--executor", "worktree", "--workspace", str(repo))


def _nothing_in(directory: Path) -> bool:
    return not directory.exists() or not any(directory.iterdir())


def _error(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 1, proc
    error: dict[str, Any] = json.loads(proc.stdout)["error"]
    return error


def test_scenario_d_a_shared_root_owned_repository_gets_a_worktree_an_agent_commits_in(
        kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 45 scenario D (success): root's repository shared with every uid; the worktree is
    created, an agent commits on its branch, and the agents' uid was given exactly the admin
    directory and the branch's ref and reflog directories."""
    repo = _repository(short_tmp / "repo", shared=True)
    before = _snapshot(repo / ".git")
    k = kandev_factory()
    k.up()
    created = _create(k, repo)
    assert created.returncode == 0, created
    task = json.loads(created.stdout)["task_id"]

    agent = pwd.getpwnam("kandev-agent")
    after = _snapshot(repo / ".git")
    given = {p for p, e in after.items() if e[2] == agent.pw_uid}
    expected_roots = (f"worktrees/{task}", "refs/heads/kandev", "logs/refs/heads/kandev")
    assert given == {p for p in after if any(p == r or p.startswith(r + "/") for r in expected_roots)}, given
    assert f"worktrees/{task}/index" in given and f"refs/heads/kandev/{task}" in given
    moved = {p for p in before if after[p][:4] != before[p][:4]}
    assert not moved, f"paths of the user's repository changed kind, owner or mode: {moved}"

    sid = k.cli("session", "start", task)["session_id"]
    wait_until(lambda: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=60)
    k.cli("prompt", sid, "/sh echo work > made.txt && git add made.txt && git -c user.name=a"
          " -c user.email=a@example.invalid commit -q -m 'agent work' && git status --short && echo COMMITTED",
          "--wait", timeout=180)
    said = agent_said(k.show(sid))
    assert said.startswith("sh: exit=0\n") and "COMMITTED" in said, said
    assert _git(repo, "log", "-1", "--format=%s", f"kandev/{task}").strip() == "agent work"


def test_scenario_d_a_failed_create_leaves_nothing_behind(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 45 scenario D (nothing left behind): the checkout of a shared repository fails (a
    required smudge filter fails inside the sandbox); the refusal quotes git, and the repository
    (its ``worktrees/`` too, which this attempt made) and the home's worktrees are as before."""
    repo = _repository(short_tmp / "repo", shared=False)
    _git(repo, "config", "filter.boom.smudge", "false")
    _git(repo, "config", "filter.boom.required", "true")
    (repo / ".gitattributes").write_text("*.txt filter=boom\n")
    (repo / "a.txt").write_text("a\n")
    _git(repo, "-c", "filter.boom.clean=cat", "add", ".gitattributes", "a.txt")
    _git(repo, "-c", "filter.boom.clean=cat", "commit", "-q", "-m", "filtered")
    subprocess.run(["chmod", "-R", "a+rwX", str(repo)], check=True, timeout=60)
    before = _snapshot(repo)
    assert not (repo / ".git" / "worktrees").exists()
    k = kandev_factory()
    k.up()
    error = _error(_create(k, repo))
    assert error["code"] == "invalid_argument" and "smudge filter boom failed" in error["message"], error
    assert _snapshot(repo) == before
    assert _nothing_in(k.home / "worktrees")
    assert "kandev/" not in _git(repo, "branch", "--list")
    assert k.cli("task", "list")["tasks"] == []


@pytest.mark.parametrize("private", [".", "objects"])
def test_scenario_d_a_repository_not_shared_is_refused_before_anything_is_created(
        kandev_factory: Any, short_tmp: Path, private: str) -> None:
    """Issue 45 scenario D (refused cleanly): a root-owned repository with root's default modes, or
    one shared but for its ``objects``, is refused before anything is created, with a message that
    says how to share the repository; nothing of it changes."""
    repo = _repository(short_tmp / "repo", shared=private != ".")
    if private != ".":
        subprocess.run(["chmod", "-R", "go-w", str(repo / ".git" / private)], check=True, timeout=60)
    before = _snapshot(repo)
    k = kandev_factory()
    k.up()
    error = _error(_create(k, repo))
    assert error["code"] == "workspace_not_writable", error
    uid = pwd.getpwnam("kandev-agent").pw_uid
    message = error["message"]
    assert f"the repository {repo} is not shared with the agents" in message, message
    assert os.path.normpath(repo / ".git" / private) in message and f"uid {uid}" in message, message
    assert f"chown -R kandev-agent: {repo}" in message and f"chmod -R g+rwX {repo}" in message, message
    assert _snapshot(repo) == before
    assert _nothing_in(k.home / "worktrees")
