"""Hostile workspaces (Issue 19): nothing an agent writes makes kandev delete, bind or run anything
outside its sandbox, through the real daemons (kandev running as the test's user, root here),
attacking from inside with the mock agent's ``/sh``. Each test cites its scenario:

- A: a planted ``.git`` file (a fake git directory whose ``worktrees`` is a symlink to a directory of
  canary files, and the worktree's own admin ``commondir`` naming another whose ``worktrees`` is the
  kandev home), then ``task delete --stop``: every canary and the home survive; exactly the recorded
  worktree and admin directory go.
- B: a planted ``.git`` file whose ``commondir`` names a directory outside, then the agent exits;
  ``kandev resume``, ``reset-context --restart`` and an automatic resume each give an agent that
  cannot write that directory, cannot list ``<home>/sessions``, and works in its own workspace.
- C: from a worktree session, writing the repository's config, hooks, info/attributes (and the
  other ways to reach the next git on the host: ``config.worktree``, ``commondir``, the main index,
  other worktrees' admin dirs) fails, while commit, branch and rebase work; a sibling session's and
  the user's own ``git status`` run no fsmonitor; with a filter, attributes, hooks and an fsmonitor
  planted by the test anyway, a new ``task create --executor worktree`` runs none of them outside a
  sandbox (the filter runs, contained, inside one).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.hostile_workspaces import (
    GIT,
    agent_said,
    canary_script,
    contained_attempts,
    parse_tree,
    plant_commondir,
    plant_gitdir,
    plant_repository,
    repository_attempts,
    repository_script,
    tree_argv,
)
from tests.support.kandev import Kandev
from tests.support.processes import alive
from tests.support.sandbox_attacks import attack_script, attack_verdicts
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(300)


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=30).stdout


def _shell(script: str) -> str:
    return subprocess.run(["sh", "-c", script], check=True, capture_output=True, text=True, timeout=60).stdout


def _repository(path: Path) -> Path:
    _shell(repository_script(str(path)))
    for_agent(path / ".git")  # the agent commits into it
    return path


def _sh(k: Kandev, sid: str, script: str) -> str:
    k.cli("prompt", sid, "/sh " + script, "--wait")
    said = agent_said(k.show(sid))
    assert said.startswith("sh: "), said
    return said


def _worktree_session(k: Kandev, repo: Path, title: str) -> tuple[str, str]:
    task = k.cli("task", "create", "--title", title, "--executor", "worktree", "--workspace", str(repo))["task_id"]
    sid = k.cli("session", "start", task)["session_id"]
    wait_until(lambda: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=60)
    return task, sid


def _tree(root: Path) -> dict[str, str]:
    """Every entry below ``root`` (relative path -> content, ``<dir>``, ``-> target``)."""
    return parse_tree(subprocess.run(tree_argv(str(root)), check=True, capture_output=True, text=True,
                                     timeout=60).stdout)


def test_scenario_a_a_planted_gitdir_never_decides_what_task_delete_removes(kandev_factory: Any,
                                                                           short_tmp: Path) -> None:
    """Issue 19 scenario A."""
    repo = _repository(short_tmp / "repo")
    canary = short_tmp / "canary"
    _shell(canary_script(str(canary)))
    before = _tree(canary)
    k = kandev_factory()
    k.up()
    other_task, other_sid = k.start_session("bystander")
    task, sid = _worktree_session(k, repo, "attacker")
    home_before = sorted(p.name for p in k.home.iterdir())
    ws = k.home / "worktrees" / task
    admin = repo / ".git" / "worktrees" / task
    assert (ws / ".git").read_text().strip() == f"gitdir: {admin}"

    said = _sh(k, sid, plant_gitdir(str(canary), str(k.home), str(admin)))
    assert "planted" in said, said

    out = k.cli("task", "delete", task, "--stop")
    assert out["deleted"] is True and out["stopped"] == [sid], out
    assert out["worktree"] == f"removed; its branch kandev/{task} is kept"
    assert _tree(canary) == before  # every canary survives
    assert sorted(p.name for p in k.home.iterdir()) == home_before  # the home is whole
    assert not ws.exists() and not admin.exists()  # exactly what was recorded went
    assert {os.path.realpath(ws), os.path.realpath(admin)} <= set(out["removed"]), out
    assert f"kandev/{task}" in _git("branch", "--list", cwd=repo)
    assert str(ws) not in _git("worktree", "list", cwd=repo)
    assert k.status()["backend"]["state"] == "ready"
    assert k.show(other_sid)["live"] and other_task in str(k.cli("board"))
    k.cli("prompt", other_sid, "still here", "--wait")


def _exit_agent(k: Kandev, sid: str) -> None:
    k.cli("prompt", sid, "/exit 1")
    wait_until(lambda: (s := k.show(sid))["state"] == "FAILED" and not s["live"], timeout=30)


def _contained(k: Kandev, sid: str, bystander: str, outside: Path, admin: Path) -> None:
    """The agent of ``sid`` cannot write ``outside`` nor list ``<home>/sessions``: only its own
    session directory is bound there (at its own path; the parents bwrap makes for it in its
    read-only tmpfs root are traverse-only, and ``bystander``'s is absent), and it works in its
    workspace, its HOME and its own admin directory (``contained_attempts``)."""
    denied, allowed = contained_attempts(str(k.home), bystander, str(outside), str(admin))
    said = _sh(k, sid, attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    assert not (outside / "pwned").exists()
    assert sorted(p.name for p in (k.home / "sessions").iterdir()) == sorted([sid, bystander])


def test_scenario_b_a_planted_commondir_never_decides_what_a_new_agent_sees(kandev_factory: Any,
                                                                           short_tmp: Path) -> None:
    """Issue 19 scenario B: resume, reset-context --restart and an automatic resume after a backend
    restart (survival off: the agent dies with it)."""
    repo = _repository(short_tmp / "repo")
    outside = short_tmp / "outside"
    outside.mkdir()
    (outside / "precious").write_text("the user's\n")
    k = kandev_factory(KANDEV_FEATURES_AUTO_RESUME="true")
    k.up()
    _, bystander = k.start_session("bystander")
    task, sid = _worktree_session(k, repo, "b")
    admin = repo / ".git" / "worktrees" / task
    said = _sh(k, sid, plant_commondir(str(outside), str(admin)))
    assert "planted" in said, said
    _exit_agent(k, sid)

    k.cli("resume", sid)
    wait_until(lambda: (s := k.show(sid))["live"] and s["state"] == "WAITING_FOR_INPUT", timeout=60)
    _contained(k, sid, bystander, outside, admin)

    pid = k.show(sid)["agent_pid"]
    k.cli("session", "reset-context", sid, "--restart")
    wait_until(lambda: (s := k.show(sid))["live"] and s["agent_pid"] != pid and s["state"] == "WAITING_FOR_INPUT",
               timeout=60)
    _contained(k, sid, bystander, outside, admin)

    pid = k.show(sid)["agent_pid"]
    backend = k.status()["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)  # survival off: the control server and the agent go with it
    wait_until(lambda: not alive(backend) and not alive(pid), timeout=30)
    k.up()
    show = wait_until(lambda: s if (s := k.show(sid))["live"] and s["state"] == "WAITING_FOR_INPUT" else None,
                      timeout=90)
    assert show["agent_pid"] != pid
    _contained(k, sid, bystander, outside, admin)
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]


def test_scenario_c_the_repository_is_not_the_agents_to_reconfigure(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 19 scenario C."""
    repo = _repository(short_tmp / "repo")
    ran = short_tmp / "ran"  # anything that runs outside a sandbox leaves a file here
    ran.mkdir()
    k = kandev_factory()
    k.up()
    task, sid = _worktree_session(k, repo, "attacker")
    sibling_task, sibling = _worktree_session(k, repo, "sibling")
    common = repo / ".git"
    ws = k.home / "worktrees" / task
    denied, allowed = repository_attempts(str(common), str(ws), str(ran), sibling_task)
    said = _sh(k, sid, attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    # The other worktrees' admin entries are an empty tmpfs inside: what is made there stays there.
    _sh(k, sid, f"mkdir {common}/worktrees/planted")
    assert sorted(p.name for p in (common / "worktrees").iterdir()) == sorted([task, sibling_task])
    assert _git("log", "--format=%s", f"kandev/{task}", cwd=repo).split() == ["two", "init"]  # rebased
    assert "feature" in _git("branch", "--list", cwd=repo)
    assert not (common / "commondir").exists() and not (common / "config.worktree").exists()

    # A sibling session's and the user's own git status run no fsmonitor (nor anything else).
    said = _sh(k, sibling, "git status --porcelain && echo status-ok")
    assert "status-ok" in said, said
    _git("status", "--porcelain", cwd=repo)
    _git("commit", "-q", "--allow-empty", "-m", "the user's", cwd=repo)
    assert list(ran.iterdir()) == []

    # Planted anyway (as the user could have): a smudge filter for every file, hooks, an fsmonitor;
    # each leaves a file in ``ran`` if it runs on the host (plant_repository).
    _shell(plant_repository(str(repo), str(ran), str(short_tmp / "fsmonitor-program")))
    created = k.cli("task", "create", "--title", "new", "--executor", "worktree", "--workspace", str(repo))
    new_ws = Path(created["workspace"])
    assert list(ran.iterdir()) == []  # nothing ran outside a sandbox
    assert (new_ws / "README").read_text() == "hello\n"
    # The filter did run, inside the checkout's sandbox (where the outside directory is absent).
    assert (new_ws / "filter-ran-inside-a-sandbox").exists()
