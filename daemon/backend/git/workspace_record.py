"""The recorded host paths of a task's workspace, and the checks every host action makes first.

An agent writes whatever it likes in its workspace: a ``.git`` file naming another git directory,
a ``commondir`` naming any path, a symlink where a directory was. So kandev never derives a host
path from the workspace. What it acts on for a task is recorded in the store (``task_workspaces``)
when the task is created, and before any removal, bind or git on the host the path on disk is
checked against that record (``check_dir``): it is a real directory (``lstat``: no symlink), its
resolved path is the recorded one (no symlinked component above it either), and it has the
recorded owner.

- every task: the workspace (``path``, resolved, and the owner of its top directory); ``created``
  when kandev made it (``<home>/worktrees/<task id>``, removed with the task);
- a git worktree also: the repository the user named, its git directory (``git_common_dir``, the
  one ``git worktree add`` ran on) and the worktree's administrative directory in it
  (``git_admin_dir``, ``<git_common_dir>/worktrees/<task id>``).

``repository_view`` is what a worktree's sandbox shows of the repository, from the record only:
the git directory read-only (its ``config``, ``hooks/``, ``info/``, ``HEAD``, ``packed-refs`` and
every other file at its top), ``objects/``, ``refs/`` and ``logs/`` read-write (a commit, a branch,
a fetch, a rebase), ``worktrees/`` an empty tmpfs with only this worktree's own administrative
directory bound read-write in it (its ``HEAD``, index, ``FETCH_HEAD``, rebase state).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from dataclasses import dataclass

from daemon.store.models import TaskWorkspace
from ipc.errors import ErrorCode, IpcError

WORKTREES = "worktrees"
WRITABLE_GIT_DIRS = ("objects", "refs", "logs")
"""What a worktree session writes in the repository's git directory besides its own admin dir."""


class RecordMismatch(Exception):
    """A path on disk is not what the record says (a symlink, another path, another owner)."""


@dataclass(frozen=True)
class WorkspaceRecord:
    """One ``task_workspaces`` row (see the module docstring)."""

    path: str
    owner_uid: int
    created: bool = False
    repository: str | None = None
    git_common_dir: str | None = None
    git_admin_dir: str | None = None
    git_owner_uid: int | None = None

    @property
    def is_worktree(self) -> bool:
        return self.git_common_dir is not None and self.git_admin_dir is not None

    def row(self, task_id: str) -> TaskWorkspace:
        return TaskWorkspace(task_id=task_id, path=self.path, owner_uid=self.owner_uid, created=self.created,
                             repository=self.repository, git_common_dir=self.git_common_dir,
                             git_admin_dir=self.git_admin_dir, git_owner_uid=self.git_owner_uid)

    @classmethod
    def from_row(cls, row: TaskWorkspace) -> WorkspaceRecord:
        return cls(path=row.path, owner_uid=row.owner_uid, created=bool(row.created), repository=row.repository,
                   git_common_dir=row.git_common_dir, git_admin_dir=row.git_admin_dir,
                   git_owner_uid=row.git_owner_uid)


def load(db: object, task_id: str) -> WorkspaceRecord | None:
    """The record of ``task_id`` (None: a task created before records existed)."""
    row = db.get(TaskWorkspace, task_id)  # type: ignore[attr-defined]
    return None if row is None else WorkspaceRecord.from_row(row)


def check_dir(path: str, owners: Collection[int] | None, what: str) -> os.stat_result:
    """``path`` is a real directory (not a symlink), at its resolved path, owned by one of
    ``owners`` (None: any owner). Raises ``RecordMismatch`` saying what differs."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise RecordMismatch(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise RecordMismatch(f"{what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise RecordMismatch(f"{what} {path} is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise RecordMismatch(f"{what} {path} is not a directory")
    if os.path.realpath(path) != path:
        raise RecordMismatch(f"{what} {path} resolves to {os.path.realpath(path)} (a symlink above it)")
    if owners is not None and st.st_uid not in owners:
        raise RecordMismatch(f"{what} {path} is owned by uid {st.st_uid}, not {'/'.join(map(str, owners))}")
    return st


def check_workspace(rec: WorkspaceRecord) -> None:
    check_dir(rec.path, (rec.owner_uid,), "the workspace")


def check_git(rec: WorkspaceRecord) -> tuple[str, str]:
    """The recorded git directory and admin directory, checked: (common, admin)."""
    common, admin = rec.git_common_dir, rec.git_admin_dir
    if common is None or admin is None:
        raise RecordMismatch("not a worktree")
    check_dir(common, None if rec.git_owner_uid is None else (rec.git_owner_uid,), "the repository's git directory")
    # worktrees/ was made by whoever ran the first ``git worktree add``: the user or kandev.
    owners = {rec.owner_uid, os.geteuid()} | ({rec.git_owner_uid} if rec.git_owner_uid is not None else set())
    check_dir(os.path.join(common, WORKTREES), owners, "the repository's worktrees directory")
    if os.path.dirname(admin) != os.path.join(common, WORKTREES):
        raise RecordMismatch(f"the recorded admin directory {admin} is not in {common}/{WORKTREES}")
    check_dir(admin, (rec.owner_uid, os.geteuid()), "the worktree's administrative directory")
    return common, admin


@dataclass(frozen=True)
class RepositoryView:
    """What a worktree's sandbox adds for the repository (see the module docstring)."""

    readonly: tuple[str, ...] = ()
    writable: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()


def repository_view(rec: WorkspaceRecord | None) -> RepositoryView:
    """The binds of a worktree's repository, from the record only, each checked first (raises
    ``RecordMismatch``); nothing for a workspace that is no worktree (or has no record)."""
    if rec is None or not rec.is_worktree:
        return RepositoryView()
    common, admin = check_git(rec)
    writable = []
    for name in WRITABLE_GIT_DIRS:
        path = os.path.join(common, name)
        if os.path.lexists(path):  # a bare repository may have no logs/
            check_dir(path, None, f"the repository's {name} directory")
            writable.append(path)
    return RepositoryView(readonly=(common,), writable=(*writable, admin),
                          hidden=(os.path.join(common, WORKTREES),))


def launch_view(rec: WorkspaceRecord | None, workspace: str) -> RepositoryView:
    """Before a launch in ``workspace``: the workspace is the recorded one, and what the sandbox
    shows of its repository. Raises ``IpcError`` (``invalid_argument``) naming what differs."""
    try:
        if rec is not None:
            if os.path.realpath(workspace) != rec.path:
                raise RecordMismatch(f"the workspace {workspace} resolves to {os.path.realpath(workspace)},"
                                     f" not the recorded {rec.path}")
            check_workspace(rec)
        return repository_view(rec)
    except RecordMismatch as exc:
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the task's workspace is not what kandev recorded: {exc};"
                       " no agent was started") from None


def record_local(path: str, *, created: bool) -> WorkspaceRecord:
    """The record of a plain directory workspace (resolved now; its owner now)."""
    real = os.path.realpath(path)
    return WorkspaceRecord(path=real, owner_uid=os.lstat(real).st_uid, created=created)

