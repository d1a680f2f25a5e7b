"""Creating a task's git worktree without blocking the backend's event loop.

``git worktree add`` checks out a whole tree and would run the repository's hooks (a
``post-checkout`` hook may take any time, or never end). It runs here as an asyncio subprocess in
its own process group, with hooks disabled for that call (``core.hooksPath=/dev/null``; also no
fsmonitor daemon) and a time limit below the watchdog's ping interval. On a failure or a timeout
the git process group is killed and whatever the call created is removed again: the worktree
directory, its administrative entry in the repository, and the ``kandev/<task>`` branch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from daemon.agentctl.sandbox import git_dirs
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

ADD_TIMEOUT_S = 10.0
"""Seconds ``git worktree add`` may take: below the backend unit's watchdog ping interval (15 s)."""
CLEANUP_TIMEOUT_S = 5.0
_OUTPUT_LIMIT = 2000  # characters of git's stderr quoted in an error

# Per call: no hooks (post-checkout & co.), no fsmonitor process, never a terminal prompt.
_SAFE_CONFIG = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")


def _git_env() -> dict[str, str]:
    env = dict(os.environ)
    env["GIT_TERMINAL_PROMPT"] = "0"
    return env


async def _run_git(repo: str, args: list[str], timeout: float) -> tuple[int, str]:
    """Run ``git -C repo args`` in its own process group; kill the group if it outlives ``timeout``
    (raises ``TimeoutError`` then) or if we are cancelled. Returns (exit code, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        "git", *_SAFE_CONFIG, "-C", repo, *args,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True, env=_git_env(),
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


async def _remove(repo: str, target: Path, branch: str) -> None:
    """Undo a failed ``worktree add``: each step may find nothing to do."""
    for args in (["worktree", "remove", "--force", str(target)], ["worktree", "prune"],
                 ["branch", "-D", branch]):
        try:
            await _run_git(repo, args, CLEANUP_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            log.warning("worktree clean-up: git %s failed: %s", args[0], exc)
    if target.exists():
        await asyncio.to_thread(shutil.rmtree, target, True)


async def add_worktree(repo: str, target: Path, branch: str, timeout: float = ADD_TIMEOUT_S) -> None:
    """``git worktree add -b branch target`` in ``repo``, off the event loop, hooks disabled.

    Raises ``IpcError``: ``invalid_argument`` when git refuses (its message quoted), ``timeout``
    when it takes longer than ``timeout`` seconds. Either way nothing of the attempt is left.
    """
    if target.exists():  # never ours to remove on a failure
        raise IpcError(ErrorCode.CONFLICT, f"worktree path {target} already exists")
    try:
        code, err = await _run_git(repo, ["worktree", "add", "-b", branch, str(target)], timeout)
    except TimeoutError:
        await _remove(repo, target, branch)
        raise IpcError(
            ErrorCode.TIMEOUT,
            f"git worktree add took longer than {timeout:g} s and was stopped; nothing was kept",
        ) from None
    except asyncio.CancelledError:
        await asyncio.shield(_remove(repo, target, branch))
        raise
    except OSError as exc:
        raise IpcError(ErrorCode.UNAVAILABLE, f"cannot run git: {exc.strerror or exc}") from None
    if code != 0:
        await _remove(repo, target, branch)
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"git worktree add failed: {err}")


async def remove_worktree(path: Path) -> None:
    """Remove a worktree kandev created (``task delete``): ``git worktree remove --force`` run in
    the repository's common git directory, then prune; its branch is kept (it may hold the agent's
    commits). A plain directory (no git worktree) is removed as it is. Off the event loop."""
    common = await asyncio.to_thread(_common_git_dir, path)
    if common is not None:
        code, err = await _run_git(common, ["worktree", "remove", "--force", str(path)], CLEANUP_TIMEOUT_S)
        await _run_git(common, ["worktree", "prune"], CLEANUP_TIMEOUT_S)
        if code != 0 and await asyncio.to_thread(path.exists):
            log.warning("git worktree remove %s failed (%s); removing the directory", path, err)
    if await asyncio.to_thread(path.exists):
        await asyncio.to_thread(shutil.rmtree, path)
        if common is not None:
            await _run_git(common, ["worktree", "prune"], CLEANUP_TIMEOUT_S)


def _common_git_dir(path: Path) -> str | None:
    """The common git directory of the linked worktree at ``path`` (None: not a linked worktree)."""
    dirs = git_dirs(str(path))
    if not dirs:
        return None
    # git_dirs gives {gitdir, common}; the worktree's own gitdir is <common>/worktrees/<name>.
    return min(dirs, key=len)
