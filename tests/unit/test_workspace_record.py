"""The recorded paths of a task's workspace and the checks before every host action
(Issue 19 item 1): a symlink, a symlinked parent, another owner or a path outside the recorded git
directory is refused; a worktree's sandbox view comes from the record only (Issue 19 item 3); the
repository kandev runs ``git worktree add`` on is a real git directory, never one a ``.git`` file
or ``commondir`` names (Issue 19 item 2). Real files in a temporary directory, no daemon."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from daemon.backend.git.workspace_record import (
    RecordMismatch,
    WorkspaceRecord,
    check_dir,
    launch_view,
    repository_view,
)
from daemon.backend.git.worktree import Repository, give_worktree, locate_repository, remove_recorded
from daemon.host.agent_user import agent_user
from ipc.errors import IpcError


def _repo(path: Path) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q", str(path)], check=True, timeout=30)
    return path


def _worktree(tmp_path: Path) -> WorkspaceRecord:
    """What ``create_worktree`` records, made by hand: a repository, its admin dir, the worktree."""
    repo = _repo(tmp_path / "repo")
    common = repo / ".git"
    admin = common / "worktrees" / "t1"
    admin.mkdir(parents=True)
    (admin / "HEAD").write_text("ref: refs/heads/kandev/t1\n")
    ws = tmp_path / "home" / "worktrees" / "t1"
    ws.mkdir(parents=True)
    (ws / ".git").write_text(f"gitdir: {admin}\n")
    uid = os.geteuid()
    return WorkspaceRecord(path=str(ws.resolve()), owner_uid=uid, created=True, repository=str(repo.resolve()),
                           git_common_dir=str(common.resolve()), git_admin_dir=str(admin.resolve()),
                           git_owner_uid=uid)


def test_check_dir_refuses_a_symlink_a_symlinked_parent_and_another_owner(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    check_dir(str(real), (os.geteuid(),), "x")
    with pytest.raises(RecordMismatch, match="is a symlink"):
        check_dir(str(tmp_path / "link"), None, "x")
    with pytest.raises(RecordMismatch, match="resolves to"):
        check_dir(str(tmp_path / "link" / "sub"), None, "x")
    with pytest.raises(RecordMismatch, match="owned by uid"):
        check_dir(str(real), (os.geteuid() + 1,), "x")
    with pytest.raises(RecordMismatch, match="does not exist"):
        check_dir(str(tmp_path / "gone"), None, "x")


def test_the_repository_view_comes_from_the_record_not_from_the_workspace(tmp_path: Path) -> None:
    rec = _worktree(tmp_path)
    common = rec.git_common_dir
    assert common is not None
    # What the agent plants in its workspace and admin dir changes nothing of the view.
    outside = tmp_path / "outside"
    outside.mkdir()
    Path(rec.path, ".git").write_text(f"gitdir: {outside}\n")
    Path(rec.git_admin_dir or "", "commondir").write_text(f"{outside}\n")
    view = launch_view(rec, rec.path)
    assert view.readonly == (common,)
    assert set(view.writable) == {f"{common}/objects", f"{common}/refs", rec.git_admin_dir}
    assert view.hidden == (f"{common}/worktrees",)
    assert not any(str(outside) in p for p in (*view.readonly, *view.writable, *view.hidden))
    # No record (a task from before records): nothing of any repository.
    assert repository_view(None).writable == ()


def test_a_symlink_in_the_recorded_repository_refuses_the_launch(tmp_path: Path) -> None:
    rec = _worktree(tmp_path)
    common = Path(rec.git_common_dir or "")
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.rename(common / "refs", tmp_path / "refs-was")
    (common / "refs").symlink_to(target)
    with pytest.raises(IpcError, match="refs directory .* is a symlink"):
        launch_view(rec, rec.path)


def test_remove_recorded_removes_exactly_the_record_and_never_through_a_symlink(tmp_path: Path) -> None:
    rec = _worktree(tmp_path)
    canary = tmp_path / "canary"
    (canary / "t1").mkdir(parents=True)
    (canary / "t1" / "keep").write_text("canary\n")
    common = Path(rec.git_common_dir or "")
    # worktrees/ swapped for a symlink to the canary (whose t1 looks like the admin dir): refused.
    os.rename(common / "worktrees", tmp_path / "worktrees-was")
    (common / "worktrees").symlink_to(canary)
    with pytest.raises(RecordMismatch, match="worktrees directory .* is a symlink"):
        remove_recorded(rec)
    assert (canary / "t1" / "keep").read_text() == "canary\n"
    (common / "worktrees").unlink()
    os.rename(tmp_path / "worktrees-was", common / "worktrees")
    assert sorted(remove_recorded(rec)) == sorted([rec.path, rec.git_admin_dir])
    assert not Path(rec.path).exists() and not Path(rec.git_admin_dir or "").exists()
    assert (common / "HEAD").exists() and (canary / "t1" / "keep").exists()
    # A workspace the user named is never removed.
    user = WorkspaceRecord(path=str(canary), owner_uid=os.geteuid(), created=False)
    assert remove_recorded(user) == [] and canary.exists()


def test_locate_repository_takes_a_real_git_directory_only(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    found = locate_repository(str(repo))
    assert (found.path, found.git_dir) == (str(repo.resolve()), str((repo / ".git").resolve()))
    bare = tmp_path / "bare.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True, timeout=30)
    assert locate_repository(str(bare)).git_dir == str(bare.resolve())

    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".git").write_text(f"gitdir: {repo / '.git'}\n")
    with pytest.raises(IpcError, match="has a .git file"):
        locate_repository(str(linked))
    symlinked = tmp_path / "symlinked"
    symlinked.mkdir()
    (symlinked / ".git").symlink_to(repo / ".git")
    with pytest.raises(IpcError, match="has a .git symlink"):
        locate_repository(str(symlinked))
    (repo / ".git" / "commondir").write_text(f"{tmp_path / 'outside'}\n")
    with pytest.raises(IpcError, match="commondir"):
        locate_repository(str(repo))
    with pytest.raises(IpcError, match="not a git repository"):
        locate_repository(str(tmp_path / "linked" / ".."))  # tmp_path itself
    with pytest.raises(IpcError, match="absolute"):
        locate_repository("relative/repo")


@pytest.mark.skipif(os.geteuid() != 0, reason="agents keep our own uid when kandev is not root: nothing is given")
@pytest.mark.parametrize("planted", ["refs/heads", "refs/heads/kandev"])
def test_give_worktree_never_follows_a_symlink_in_the_repository(tmp_path: Path, planted: str) -> None:
    """Issue 45 item 4: what kandev gives the agents' uid in a repository is reached one component
    at a time from the git directory; a symlink planted where git made a directory (at the branch's
    ref directory or above it) fails the creation and nothing it names changes owner (the repository
    given to the agents' uid, where a symlinked ``refs/heads`` was once followed)."""
    repo = _repo(tmp_path / "repo")
    git_dir = repo / ".git"
    (git_dir / "worktrees" / "t1").mkdir(parents=True)
    outside = tmp_path / "outside"
    (outside / "kandev").mkdir(parents=True)
    (outside / "kandev" / "t1").write_text("x")
    link = git_dir / planted
    if link.exists():
        os.rename(link, tmp_path / "moved")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside if planted == "refs/heads" else outside / "kandev")
    target = tmp_path / "home" / "worktrees" / "t1"
    target.mkdir(parents=True)
    with pytest.raises(RecordMismatch, match="is not a directory"):
        give_worktree(Repository(str(repo), str(git_dir), agent_user().uid), target, "kandev/t1")
    assert {os.lstat(p).st_uid for p in (outside, outside / "kandev", outside / "kandev" / "t1")} == {0}
