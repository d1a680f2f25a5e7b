"""``kandev task delete``: a task goes with its sessions' directories (each agent's HOME) and the
workspace kandev made for it; other tasks' sessions are untouched. Issue 12 item 2 (the
per-session HOME is "removed with its task"), through the real daemons and the real CLI."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from tests.support.kandev import db_row
from tests.support.processes import alive, group_alive, signal_pending, stopped_in_group
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent


def _git(*args: str, cwd: Path) -> str:
    # safe.directory: the repository's git directory belongs to the agents' uid (for_agent)
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "safe.directory=*", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


def _exit_agent(k, sid: str) -> None:
    k.cli("prompt", sid, "/exit 1")
    wait_until(lambda: (s := k.show(sid))["state"] == "FAILED" and not s["live"], timeout=30)


def test_task_delete_removes_its_session_homes_and_leaves_others(kandev_factory, short_tmp):
    """Issue 12 item 2: deleting a task removes <home>/sessions/<sid>/ (the agent's HOME) of
    each of its sessions and the workspace kandev created; refused while an agent runs; an unknown
    id is not_found; another task's session keeps its HOME and its agent."""
    k = kandev_factory()
    k.up()
    sessions = k.home / "sessions"
    task_a, sid_a = k.start_session("a")
    task_b, sid_b = k.start_session("b")
    k.cli("prompt", sid_a, "hello a", "--wait")
    k.cli("prompt", sid_b, "hello b", "--wait")
    home_a, home_b = sessions / sid_a / "agent" / "home", sessions / sid_b / "agent" / "home"
    assert home_a.is_dir() and home_b.is_dir()
    (home_b / "note").write_text("kept")
    ws_a = Path(k.cli("task", "show", task_a)["workspace"])
    assert ws_a == k.home / "worktrees" / task_a and ws_a.is_dir()

    # A live agent: refused, nothing removed.
    proc = k.run("task", "delete", task_a)
    assert proc.returncode == 1, proc
    assert '"conflict"' in proc.stdout and sid_a in proc.stdout
    assert home_a.is_dir() and ws_a.is_dir() and k.show(sid_a)["live"]

    # Unknown id: a typed error, nothing changes.
    proc = k.run("task", "delete", "no-such-task")
    assert proc.returncode == 1 and '"not_found"' in proc.stdout, proc

    # --stop: the idle agent is stopped first (its process group killed), then the task goes.
    pid_a = k.show(sid_a)["agent_pid"]
    out = k.cli("task", "delete", task_a, "--stop")
    assert out["deleted"] is True and out["sessions"] == [sid_a] and out["stopped"] == [sid_a]
    assert out["worktree"] == "removed"
    wait_until(lambda: not alive(pid_a), timeout=10)
    assert str(sessions / sid_a) in out["removed"] and str(ws_a) in out["removed"]
    assert not (sessions / sid_a).exists() and not ws_a.exists()
    assert db_row(k, "SELECT id FROM tasks WHERE id = ?", task_a) is None
    assert db_row(k, "SELECT id FROM task_sessions WHERE id = ?", sid_a) is None
    assert db_row(k, "SELECT session_id FROM executors_running WHERE session_id = ?", sid_a) is None
    proc = k.run("session", "show", sid_a)
    assert proc.returncode == 1 and '"not_found"' in proc.stdout

    # The other task: its session's HOME, its agent and its conversation are as they were.
    assert (home_b / "note").read_text() == "kept"
    show_b = k.show(sid_b)
    assert show_b["live"] and show_b["state"] == "WAITING_FOR_INPUT"
    k.cli("prompt", sid_b, "still here", "--wait")
    assert db_row(k, "SELECT id FROM tasks WHERE id = ?", task_b) is not None

    # A git worktree kandev created goes (its branch stays); a workspace the user named stays.
    repo = short_tmp / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    _git("commit", "-q", "--allow-empty", "-m", "first", cwd=repo)
    for_agent(repo / ".git")  # the agent commits into it
    task_w = k.cli("task", "create", "--title", "w", "--executor", "worktree", "--workspace", str(repo))["task_id"]
    sid_w = k.cli("session", "start", task_w)["session_id"]
    k.show(sid_w)
    ws_w = k.home / "worktrees" / task_w
    assert ws_w.is_dir()
    # A turn still running: refused even with --stop, nothing removed.
    k.cli("prompt", sid_w, "/slow 60")
    wait_until(lambda: k.show(sid_w)["state"] == "RUNNING", timeout=30)
    proc = k.run("task", "delete", task_w, "--stop")
    assert proc.returncode == 1 and '"conflict"' in proc.stdout and "kandev cancel" in proc.stdout, proc
    assert ws_w.is_dir() and (sessions / sid_w).is_dir()
    k.cli("cancel", sid_w)
    wait_until(lambda: k.show(sid_w)["state"] == "WAITING_FOR_INPUT", timeout=30)
    _exit_agent(k, sid_w)
    human = k.human("task", "delete", task_w)
    assert human.returncode == 0, human
    assert "deleted with 1 session" in human.stdout and f"branch kandev/{task_w} is kept" in human.stdout
    assert not ws_w.exists() and not (sessions / sid_w).exists()
    assert str(ws_w) not in _git("worktree", "list", cwd=repo)
    assert f"kandev/{task_w}" in _git("branch", "--list", cwd=repo)

    own = short_tmp / "own"
    own.mkdir()
    (own / "work.txt").write_text("mine")
    for_agent(own)
    task_o = k.cli("task", "create", "--title", "o", "--workspace", str(own))["task_id"]
    sid_o = k.cli("session", "start", task_o)["session_id"]
    k.show(sid_o)
    _exit_agent(k, sid_o)
    out = k.cli("task", "delete", task_o)
    assert out["worktree"] == "kept (not created by kandev)"
    assert (own / "work.txt").read_text() == "mine" and not (sessions / sid_o).exists()
    assert (home_b / "note").read_text() == "kept" and k.show(sid_b)["live"]


# Run by the agent: once the file "go" appears in its workspace, it stops itself (SIGSTOP), so a
# stop's SIGTERM stays pending and the control server waits its whole grace before SIGKILL.
STOP_ITSELF_LATER = "/sh (while [ ! -e go ]; do sleep 0.05; done; kill -STOP $PPID) >/dev/null 2>&1 &"


def test_no_turn_starts_while_a_deletion_stops_the_task_agents(kandev_factory):
    """``task delete --stop`` stops the task's idle agents one after the other, each up to the
    control server's grace. A prompt that came meanwhile used to start a turn on an agent still to
    be stopped: the deletion then killed it mid-turn and deleted its session. Now every prompt to
    the task is refused while its deletion runs, and the deletion completes."""
    k = kandev_factory()
    k.up()
    task = k.cli("task", "create", "--title", "t")["task_id"]
    sids = [k.cli("session", "start", task)["session_id"] for _ in range(2)]
    workspace = Path(k.cli("task", "show", task)["workspace"])
    for sid in sids:
        assert k.cli("prompt", sid, STOP_ITSELF_LATER, "--wait")["stop_reason"] == "end_turn"
    groups = [k.show(sid)["agent_pid"] for sid in sids]
    (workspace / "go").touch()
    stopped = {pgid: wait_until(lambda g=pgid: s if (s := stopped_in_group(g)) else None, timeout=30)
               for pgid in groups}

    deletion = k.popen("task", "delete", task, "--stop", json_output=True)
    # the deletion has begun: one of the two agents holds its SIGTERM, the stop waits its grace
    wait_until(lambda: any(signal_pending(pid, signal.SIGTERM) for pids in stopped.values() for pid in pids),
               timeout=30)
    # both at once, inside the first stop's grace: a session whose agent is already stopped and no
    # longer tracked says so; one still to be stopped says its task is being deleted
    prompts = [k.popen("prompt", sid, "hello", json_output=True) for sid in sids]
    said = [p.communicate(timeout=60)[0].decode() for p in prompts]
    for prompt, out in zip(prompts, said, strict=True):
        assert prompt.returncode == 1 and '"conflict"' in out, out
        assert "being deleted" in out or "has no running agent" in out, out
    assert any("being deleted" in out for out in said), said
    out, err = deletion.communicate(timeout=60)
    assert deletion.returncode == 0, (out, err)
    result = json.loads(out)
    assert result["deleted"] is True and sorted(result["stopped"]) == sorted(sids)
    assert db_row(k, "SELECT id FROM tasks WHERE id = ?", task) is None
    for pgid in groups:
        wait_until(lambda g=pgid: not group_alive(g), timeout=10)
