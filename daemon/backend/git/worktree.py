"""A task's git worktree: created on recorded paths, checked out inside a sandbox, removed without git.

A repository's config, attributes and hooks may have been written by an agent (or by anyone the
user let near it), so the host never runs what they name. Creating a worktree
(``create_worktree``) takes three steps:

1. ``locate_repository``: the directory the user named must be a repository's top directory with
   a real ``.git`` directory (or a bare repository itself), no symlink, no ``commondir`` (a linked
   worktree's or a submodule's git dir is refused: name the main repository). Its git directory and
   owner are what gets recorded. When agents run as their own uid (kandev runs as root: agents run
   as ``kandev-agent``), ``check_shared`` then refuses, before anything is created, a repository
   that uid cannot commit into (its git directory, ``objects``, ``refs`` and ``logs`` each writable
   by it: given to it, or shared through a group or with every uid), saying how to share it.
2. on the host, ``git worktree add --no-checkout -b kandev/<task> <home>/worktrees/<task>`` with
   the git directory named explicitly (``--git-dir``, no discovery) and a hardened environment
   (``host_git_env``, ``HOST_GIT_CONFIG``): no system or global config, no hooks
   (``core.hooksPath=/dev/null``), no fsmonitor, no pager, no prompt. ``--no-checkout`` writes no
   file of the tree, so no filter, ``textconv`` or other attribute-driven program runs; what the
   repository's config could still name (``sshCommand``, credential helpers, diff and merge
   drivers) has no part in a local ``worktree add``. The new admin directory must be
   ``<git dir>/worktrees/<task>`` and the new ``.git`` file must name it, else the attempt is undone.
   What git made there as kandev's uid is then given to the agents' uid, exactly as far as the
   worktree needs it (``give_worktree``): its admin directory and its branch's ref and reflog
   directories, never following a symlink; a repository the user shared keeps every other owner
   and mode.
3. inside a sandbox, as an agent would run: ``git reset --hard`` populates the index and the files
   (smudge filters and whatever the repository defines run there, contained), with the same view of
   the repository an agent of the task gets (``daemon.backend.git.workspace_record.repository_view``).
   With ``agents.sandbox = "off"`` agents run unsandboxed, and so does this step.

Each git step runs as an asyncio subprocess in its own process group with a time limit below the
watchdog's ping interval; on a failure or a timeout the group is killed and everything is undone:
the worktree directory, its admin directory (and ``worktrees/`` when the attempt made it), the
``kandev/<task>`` branch: the repository is left as it was.

``remove_recorded`` (``task delete``) runs no git at all: the recorded worktree directory and the
recorded admin directory are each checked against the record and removed (``shutil.rmtree`` never
follows a symlink); the branch is kept. Nothing in the workspace (``.git``, ``gitdir``,
``commondir``, a symlinked ``worktrees``) can name what is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from daemon.agentctl.sandbox import bubblewrap as sandbox
from daemon.agentctl.sandbox.bubblewrap import SandboxPolicy, SandboxRequest
from daemon.backend.git.workspace_record import (
    WORKTREES,
    WRITABLE_GIT_DIRS,
    RecordMismatch,
    WorkspaceRecord,
    check_dir,
    check_git,
    check_workspace,
    repository_view,
)
from daemon.host.agent_user import (
    AgentUser,
    AgentUserMissing,
    agent_user,
    cannot_write,
    fix_hint,
    give,
    give_fd,
)
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

ADD_TIMEOUT_S = 10.0
"""Seconds each step of a worktree creation may take: below the backend unit's watchdog ping interval (15 s)."""
CLEANUP_TIMEOUT_S = 5.0
_OUTPUT_LIMIT = 2000  # characters of git's stderr quoted in an error

HOST_GIT_CONFIG = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "core.pager=cat",
                   "-c", "core.sshCommand=false", "-c", "credential.helper=", "-c", "protocol.allow=never",
                   "-c", "worktree.useRelativePaths=false")
"""Per host git call: no hook, no fsmonitor, no pager, no ssh, no credential helper, no transport."""
CHECKOUT = ("git", "-c", "core.fsmonitor=false", "reset", "--hard", "--quiet")
"""What populates a new worktree, inside its sandbox."""
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def host_git_env() -> dict[str, str]:
    """The whole environment of a host git call: the daemon's PATH (to find git) and nothing that
    names a program or a config file (no system or global config, no attributes of the system)."""
    return {"PATH": os.environ.get("PATH", SYSTEM_PATH), "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
            "GIT_PAGER": "cat", "GIT_OPTIONAL_LOCKS": "0", "GIT_NO_REPLACE_OBJECTS": "1"}


async def _run(argv: Sequence[str], timeout: float, env: dict[str, str], cwd: str = "/",
               pass_fds: Sequence[int] = ()) -> tuple[int, str]:
    """Run ``argv`` in its own process group; kill the group if it outlives ``timeout`` (raises
    ``TimeoutError`` then) or if we are cancelled. Returns (exit code, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True, env=env, cwd=cwd, pass_fds=tuple(pass_fds),
    )
    try:
        _, err = await within(proc.communicate(), timeout)
    except BaseException:  # TimeoutError or cancellation: nothing of it may stay behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await within(proc.wait(), CLEANUP_TIMEOUT_S)
        raise
    return proc.returncode or 0, err.decode(errors="replace").strip()[-_OUTPUT_LIMIT:]


async def host_git(git_dir: str, args: Sequence[str], timeout: float) -> tuple[int, str]:
    """``git --git-dir=<git_dir> <args>`` on the host, hardened (see the module docstring)."""
    return await _run(["git", f"--git-dir={git_dir}", *HOST_GIT_CONFIG, *args], timeout, host_git_env())


# ---------------------------------------------------------------- the repository the user named


@dataclass(frozen=True)
class Repository:
    path: str  # resolved: the top directory (or the bare repository)
    git_dir: str  # resolved: its git directory
    owner_uid: int  # the git directory's owner


def _bad_repo(workspace: str, why: str) -> IpcError:
    return IpcError(ErrorCode.INVALID_ARGUMENT, f"executor 'worktree' needs --workspace naming a git repository's"
                    f" top directory: {workspace} {why}")


def locate_repository(workspace: str) -> Repository:
    """The repository at ``workspace`` (blocking; see the module docstring). Raises ``IpcError``."""
    if not os.path.isabs(workspace):
        raise _bad_repo(workspace, "is not an absolute path")
    top = os.path.realpath(workspace)
    if not os.path.isdir(top):
        raise _bad_repo(workspace, "is not an existing directory")
    dotgit = os.path.join(top, ".git")
    try:
        st = os.lstat(dotgit)
    except FileNotFoundError:
        st = None
    if st is None:
        bare = all(os.path.isdir(os.path.join(top, d)) for d in ("objects", "refs")) and \
            os.path.isfile(os.path.join(top, "HEAD"))
        if not bare:
            raise _bad_repo(workspace, "is not a git repository (no .git directory)")
        git_dir = top
    elif stat.S_ISDIR(st.st_mode):
        git_dir = dotgit
    elif stat.S_ISLNK(st.st_mode):
        raise _bad_repo(workspace, "has a .git symlink (refused: kandev acts only on a real git directory)")
    else:
        raise _bad_repo(workspace, "has a .git file: it is a linked worktree or a submodule; name the main"
                        " repository instead")
    if os.path.lexists(os.path.join(git_dir, "commondir")):
        raise _bad_repo(workspace, f"has a git directory with a commondir file ({git_dir}): name the main"
                        " repository instead")
    try:
        gst = check_dir(git_dir, None, "the git directory")
        for name in ("objects", "refs"):
            check_dir(os.path.join(git_dir, name), None, f"the git directory's {name}")
        if os.path.lexists(os.path.join(git_dir, WORKTREES)):
            check_dir(os.path.join(git_dir, WORKTREES), None, f"the git directory's {WORKTREES}")
    except RecordMismatch as exc:
        raise _bad_repo(workspace, f"cannot be used: {exc}") from None
    return Repository(top, git_dir, gst.st_uid)


# ---------------------------------------------------------------- create


@dataclass(frozen=True)
class CheckoutSandbox:
    """How the checkout step is contained: the agents' policy, their ``bwrap`` and what they never see."""

    policy: SandboxPolicy
    hidden: tuple[str, ...]
    bwrap: str | None = None


def checkout_argv(rec: WorkspaceRecord, box: CheckoutSandbox) -> sandbox.Launch:
    """The checkout command, wrapped in a sandbox showing the repository as an agent's does, and
    the descriptors it inherits (the caller closes them; blocking: reads the file system)."""
    if box.policy is SandboxPolicy.OFF:
        return sandbox.Launch(list(CHECKOUT))
    if box.bwrap is None:
        raise sandbox.unavailable(f"{sandbox.BWRAP} (bubblewrap) is not on the backend's PATH")
    view = repository_view(rec)
    request = SandboxRequest(policy=box.policy, writable=view.writable, readonly=view.readonly,
                             hidden=(*box.hidden, *view.hidden))
    return sandbox.wrap_command(request, list(CHECKOUT), rec.path, bwrap=box.bwrap)


def _checkout_env() -> dict[str, str]:
    return {"PATH": SYSTEM_PATH, "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat"}


def _created_record(repo: Repository, target: Path) -> WorkspaceRecord:
    """What ``worktree add`` made, checked: the admin directory is ``<git dir>/worktrees/<name>``
    and the new ``.git`` file names exactly it."""
    admin = os.path.join(repo.git_dir, WORKTREES, target.name)
    rec = WorkspaceRecord(path=os.path.realpath(target), owner_uid=os.lstat(target).st_uid, created=True,
                          repository=repo.path, git_common_dir=repo.git_dir, git_admin_dir=admin,
                          git_owner_uid=repo.owner_uid)
    check_workspace(rec)
    check_git(rec)
    with open(os.path.join(rec.path, ".git"), encoding="utf-8", errors="replace") as fh:
        first = fh.read(4096).strip()
    if first != f"gitdir: {admin}":
        raise RecordMismatch(f"git wrote {first!r:.200} in {target}/.git, not gitdir: {admin}")
    return rec


def check_shared(repo: Repository) -> None:
    """Refuse, before anything is created, a repository the agents' uid cannot commit into: its git
    directory and the parts of it a worktree's sandbox binds read-write (``objects``, ``refs``,
    ``logs``) must each be writable by that uid (it owns them, or the user shared them through a
    group or with every uid). Raises ``IpcError(workspace_not_writable)`` saying how to share the
    repository; a no-op when agents keep our uid. Blocking (stats)."""
    try:
        user = agent_user()
    except AgentUserMissing as exc:
        raise IpcError(ErrorCode.SANDBOX_UNAVAILABLE, str(exc), retryable=False) from None
    for name in ("", *WRITABLE_GIT_DIRS):
        path = os.path.join(repo.git_dir, name) if name else repo.git_dir
        if name and not os.path.lexists(path):
            continue  # a bare repository may have no logs/
        why = cannot_write(path, user)
        if why is not None:
            raise IpcError(ErrorCode.WORKSPACE_NOT_WRITABLE,
                           f"the repository {repo.path} is not shared with the agents: {why}. Agents commit into"
                           f" its git directory: {fix_hint(repo.path, user)}", retryable=False,
                           details={"path": repo.path, "uid": user.uid, "user": user.name})


def give_worktree(repo: Repository, target: Path, branch: str) -> None:
    """Give what ``git worktree add`` (run by kandev) just made for ``target`` to the agents' uid:
    the worktree, its admin directory ``worktrees/<name>`` (its ``HEAD``, the index the checkout
    writes) and the directories of the branch's ref and reflog (``refs/heads/kandev``,
    ``logs/refs/heads/kandev``), where its commits go; when that uid owns the git directory (the user
    gave it the repository), ``worktrees/`` itself too. Nothing else of a repository the user
    shared changes owner or mode (``check_shared`` made sure the agents may write the rest). Each
    path is reached from the git directory one component at a time, never through a symlink (a
    symlink where a directory should be fails the creation). A no-op when agents keep our uid."""
    give(target)
    user = agent_user()
    if not user.dedicated:
        return
    ref_dir = os.path.dirname(branch)  # "kandev" of "kandev/<task id>"
    given = [(os.path.join(WORKTREES, target.name), True), (os.path.join("refs", "heads", ref_dir), True),
             (os.path.join("logs", "refs", "heads", ref_dir), True)]
    if repo.owner_uid == user.uid:
        given.append((WORKTREES, False))
    for rel, recursive in given:
        _give_inside(repo.git_dir, rel, user, recursive=recursive)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _give_inside(root: str, rel: str, user: AgentUser, *, recursive: bool) -> None:
    """``give`` the directory ``root/rel`` (nothing when it does not exist), every component opened
    below the previous one's descriptor without following a symlink (raises ``RecordMismatch``)."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in rel.split(os.sep):
            try:
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return
            except OSError as exc:  # ELOOP, ENOTDIR: a symlink or a file where git made a directory
                raise RecordMismatch(f"{os.path.join(root, rel)}: {part} is not a directory ({exc.strerror})") from None
            os.close(fd)
            fd = below
        give_fd(fd, user, recursive=recursive)
    finally:
        os.close(fd)


async def create_worktree(repo: Repository, target: Path, branch: str, box: CheckoutSandbox,
                          timeout: float = ADD_TIMEOUT_S) -> WorkspaceRecord:
    """Steps 2 and 3 of the module docstring, off the event loop; the record of what was made.

    Raises ``IpcError``: ``conflict`` when ``target`` exists, ``invalid_argument`` when git
    refuses (its message quoted), ``timeout`` past ``timeout`` seconds, ``sandbox_unavailable``;
    whatever the failure, nothing of the attempt is left."""
    if target.exists() or target.is_symlink():  # never ours to remove on a failure
        raise IpcError(ErrorCode.CONFLICT, f"worktree path {target} already exists")
    made: WorkspaceRecord | None = None
    step = "git worktree add"
    had_worktrees = os.path.lexists(os.path.join(repo.git_dir, WORKTREES))
    undo = functools.partial(_undo, repo, target, branch, had_worktrees)
    try:
        code, err = await host_git(repo.git_dir, ["worktree", "add", "--no-checkout", "-b", branch, str(target)],
                                   timeout)
        if code != 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"git worktree add failed: {err}")
        # Agents run under their own uid when kandev is root: what git made for the worktree is
        # given to it first (the record then takes each owner from disk), and the checkout runs as it.
        try:
            await asyncio.to_thread(give_worktree, repo, target, branch)
            made = await asyncio.to_thread(_created_record, repo, target)
        except (RecordMismatch, OSError) as exc:
            raise IpcError(ErrorCode.INTERNAL, f"git worktree add made something unexpected: {exc}") from None
        step = "the checkout in the sandbox"
        launch = await asyncio.to_thread(checkout_argv, made, box)
        try:
            code, err = await _run(launch.argv, timeout, _checkout_env(), cwd=made.path, pass_fds=launch.fds)
        finally:
            for fd in launch.fds:
                os.close(fd)
        if code != 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"checking out the new worktree failed: {err}")
        return made
    except TimeoutError:
        await undo()
        raise IpcError(ErrorCode.TIMEOUT,
                       f"{step} took longer than {timeout:g} s and was stopped; nothing was kept") from None
    except asyncio.CancelledError:
        await asyncio.shield(undo())
        raise
    except OSError as exc:
        await undo()
        raise IpcError(ErrorCode.UNAVAILABLE, f"cannot run {step}: {exc.strerror or exc}") from None
    except BaseException:
        await undo()
        raise


async def _undo(repo: Repository, target: Path, branch: str, had_worktrees: bool) -> None:
    """Undo a failed creation: each step may find nothing to do. The admin directory is removed
    only where ``worktree add`` makes it (``<git dir>/worktrees/<name>``, checked: ours, or given
    to the agents' uid), and ``worktrees/`` itself when this attempt made it and it is empty again;
    deleting the branch removes its ref and reflog (git removes the directories it emptied)."""
    if target.is_dir() and not target.is_symlink():
        await asyncio.to_thread(shutil.rmtree, target, True)
    worktrees = os.path.join(repo.git_dir, WORKTREES)
    admin = os.path.join(worktrees, target.name)
    try:
        check_dir(worktrees, None, "worktrees")
        with contextlib.suppress(RecordMismatch):
            check_dir(admin, _undo_owners(), "admin")
            await asyncio.to_thread(shutil.rmtree, admin, True)
        if not had_worktrees:
            with contextlib.suppress(OSError):  # not empty: someone else's worktree is there now
                os.rmdir(worktrees)
    except RecordMismatch:
        pass
    try:
        await host_git(repo.git_dir, ["update-ref", "-d", f"refs/heads/{branch}"], CLEANUP_TIMEOUT_S)
    except (TimeoutError, OSError) as exc:
        log.warning("worktree clean-up: deleting branch %s failed: %s", branch, exc)


def _undo_owners() -> tuple[int, ...]:
    try:
        return (os.geteuid(), agent_user().uid)
    except AgentUserMissing:
        return (os.geteuid(),)


# ---------------------------------------------------------------- remove


def remove_recorded(rec: WorkspaceRecord) -> list[str]:
    """Remove what kandev created for a task, as recorded (blocking): the workspace directory and,
    for a worktree, its admin directory; both checked against the record first. Raises
    ``RecordMismatch`` (nothing removed) when one is not what the record says."""
    if not rec.created:
        return []
    doomed: list[str] = []  # everything is checked before anything goes
    if os.path.lexists(rec.path):
        check_workspace(rec)
        doomed.append(rec.path)
    if rec.is_worktree and rec.git_admin_dir and os.path.lexists(rec.git_admin_dir):
        doomed.append(check_git(rec)[1])
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def remove_unrecorded(path: Path) -> list[str]:
    """A workspace kandev created before records existed: the directory only, never through git
    (a worktree's admin entry is left for the user's ``git worktree prune``)."""
    if not os.path.lexists(path):
        return []
    check_dir(str(path), (os.geteuid(),), "the workspace")
    shutil.rmtree(path)
    return [str(path)]
