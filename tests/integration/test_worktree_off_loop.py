"""``task create --executor worktree`` never blocks the backend (Issue 10 item 6), real backend and git.

The worktree is created by an asyncio subprocess in its own process group with hooks disabled
and a time limit; meanwhile the backend answers ``status`` at once. Latencies are measured on the
``status`` round trip over the backend socket (what ``kandev status`` does after its interpreter
started), against a loose bound: blocked, the call would wait for the whole git run (20 s here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from daemon.api import ops as api
from daemon.backend.git.worktree import ADD_TIMEOUT_S
from ipc.client import SyncClient
from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(240)

STATUS_BOUND_S = 1.0
HOOK_SLEEP_S = 20


def _git(*args: str, cwd: Path) -> str:
    # safe.directory: the repository's git directory belongs to the agents' uid (for_agent)
    return subprocess.run(["git", "-c", "safe.directory=*", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def _repository(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    _git("init", "-q", "-b", "main", cwd=repo)
    (repo / "README").write_text("hello\n")
    _git("-c", "user.name=t", "-c", "user.email=t@example.com", "add", "README", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "init", cwd=repo)
    for_agent(repo / ".git")  # the agent commits into it
    return repo


def _status_latency(socket: str) -> float:
    start = time.monotonic()
    with SyncClient(socket, protocol_major=api.VERSION[0], timeout=10) as client:
        assert client.call("status", timeout=10)["backend"]["state"] == "ready"
    return time.monotonic() - start


def _create_in_background(k, repo: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "--home", str(k.home), "--json",
         "task", "create", "--title", "wt", "--executor", "worktree", "--workspace", str(repo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=k.env, cwd=REPO_ROOT,
    )


def _latencies_while(proc: subprocess.Popen[str], socket: str) -> list[float]:
    """``status`` latencies, one every ~0.1 s until ``proc`` ends (at least one)."""
    latencies = [_status_latency(socket)]
    while True:
        try:
            proc.wait(timeout=0.1)  # paces the probes and ends with the create
            return latencies
        except subprocess.TimeoutExpired:
            latencies.append(_status_latency(socket))


def test_scenario_d_hook_never_runs_and_status_answers(kandev_factory, short_tmp):
    """Issue 10 scenario D: a repository whose post-checkout hook takes 20 s (and would write a
    marker first): the worktree task is created without running it, and ``kandev status`` answers
    in under a second meanwhile."""
    repo = _repository(short_tmp)
    marker = short_tmp / "hook-ran"
    hook = repo / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\nsleep {HOOK_SLEEP_S}\n")
    hook.chmod(0o755)
    k = kandev_factory()
    socket = k.up()["backend"]["socket"]

    started = time.monotonic()
    proc = _create_in_background(k, repo)
    latencies = _latencies_while(proc, socket)
    elapsed = time.monotonic() - started
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    created = json.loads(out)
    assert max(latencies) < STATUS_BOUND_S, latencies
    assert elapsed < HOOK_SLEEP_S  # the hook did not hold the create either
    assert not marker.exists()  # the hook never ran
    worktree = Path(created["workspace"])
    assert (worktree / "README").read_text() == "hello\n"
    assert _git("branch", "--show-current", cwd=worktree).strip() == f"kandev/{created['task_id']}"
    assert k.cli("status")["backend"]["state"] == "ready"  # the real CLI answers too


def test_a_git_run_past_the_limit_is_killed_and_undone_while_status_answers(kandev_factory, short_tmp):
    """Issue 10 scenario D, the time limit: git itself hangs (a wrapper runs the real ``git worktree
    add``, then waits on a child). The create fails with ``timeout`` after the limit; the git
    process group is killed (the child too), the worktree and its branch are removed, and ``status``
    answered in under a second all along."""
    repo = _repository(short_tmp)
    real_git = shutil.which("git")
    assert real_git is not None
    shim_dir = short_tmp / "bin"
    shim_dir.mkdir()
    pid_file = short_tmp / "sleeper.pid"
    shim = shim_dir / "git"
    shim.write_text(
        "#!/bin/sh\n"
        'case " $* " in\n'
        f'  *" worktree add "*) {real_git} "$@" || exit $?\n'
        f"    sleep 300 & echo $! > {pid_file}; wait ;;\n"
        f'  *) exec {real_git} "$@" ;;\n'
        "esac\n"
    )
    shim.chmod(0o755)
    k = kandev_factory()
    k.env["PATH"] = f"{shim_dir}:{k.env.get('PATH', '/usr/bin:/bin')}"
    socket = k.up()["backend"]["socket"]

    started = time.monotonic()
    proc = _create_in_background(k, repo)
    latencies = _latencies_while(proc, socket)
    elapsed = time.monotonic() - started
    out, _ = proc.communicate()
    assert proc.returncode == 1
    assert json.loads(out)["error"]["code"] == "timeout"
    assert elapsed >= ADD_TIMEOUT_S
    assert len(latencies) >= 10 and max(latencies) < STATUS_BOUND_S, latencies

    sleeper = int(pid_file.read_text())
    wait_until(lambda: not psutil.pid_exists(sleeper) or psutil.Process(sleeper).status() == "zombie",
               timeout=10)
    assert list((k.home / "worktrees").iterdir()) == []
    assert "kandev/" not in _git("branch", "--list", cwd=repo)
    assert len(_git("worktree", "list", "--porcelain", cwd=repo).split("\nworktree ")) == 1


def test_a_refused_worktree_is_a_typed_error_and_leaves_nothing(kandev_factory, short_tmp):
    not_a_repo = short_tmp / "plain"
    not_a_repo.mkdir()
    k = kandev_factory()
    k.up()
    proc = k.run("task", "create", "--title", "wt", "--executor", "worktree", "--workspace", str(not_a_repo))
    assert proc.returncode == 1
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "invalid_argument" and "is not a git repository" in error["message"]
    assert list((k.home / "worktrees").iterdir()) == []
    # A repository git refuses to branch from (no commit yet): git's own message, nothing left.
    empty = short_tmp / "empty"
    empty.mkdir()
    _git("init", "-q", cwd=empty)
    for_agent(empty / ".git")  # writable by the agents' uid: git's own refusal is what is checked here
    proc = k.run("task", "create", "--title", "wt", "--executor", "worktree", "--workspace", str(empty))
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "invalid_argument" and "git worktree add failed" in error["message"], error
    assert list((k.home / "worktrees").iterdir()) == []
    assert not (empty / ".git" / "worktrees").exists() or list((empty / ".git" / "worktrees").iterdir()) == []
    assert k.cli("board")["backlog"] == []  # no task was created
