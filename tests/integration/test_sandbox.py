"""Agents are contained guests : Issue 10 scenario A and Issue 10 scenario B through the real daemons.

Issue 10 scenario A: from inside a mock agent (``/sh``), with a GitHub token configured, every
attempt to reach kandev fails (the token file, the store, the secrets, the run directory and its
sockets, the logs, another session's workspace, ``/proc/<backend>/environ``, signalling the backend,
the control server or another agent), while its own work succeeds (writing in its workspace, git,
python3, ``/git-credential`` for its own repository); the same after the backend is SIGKILLed and
the surviving agent re-tracked, and for a passthrough session. The session's credential endpoint
serves its own lease only. The home is private afterwards (item 9).

Issue 10 scenario B: with no ``bwrap`` on the control server's PATH (a real condition, not a
switch), ``session start`` fails with ``sandbox_unavailable`` naming the reason and the setting,
the session ends FAILED (never STARTING), ``kandev status`` and ``kandev doctor`` say why;
``agents.sandbox = "off"`` then starts the agent, and a warning is logged for it.

The systemd and package variants are in tests/systemd/test_survival_systemd.py and
tests/systemd/test_package.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon.agentctl.sandbox.bubblewrap import sandbox_ids
from daemon.git_credential_helper import HelperError, valid_lease
from daemon.host.agent_user import agent_user
from daemon.host.session_dirs import SessionDirs, endpoint_mode
from tests.support.kandev import Kandev, db_row
from tests.support.processes import alive
from tests.support.sandbox_attacks import attack_script, attack_verdicts, connect_argv
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

UPSTREAM = "ghp_SANDBOXupstreamToken0123456789abcdef"
CREDENTIAL_OK = "git-credential: ok repository=github.com/example/repo lease-sha256="  # the lease checks (Issue 20)
pytestmark = pytest.mark.timeout(300)


def _repo(path: Path, origin: str, *, give: bool = True) -> Path:
    path.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=path, check=True, timeout=30)
    subprocess.run(["git", "remote", "add", "origin", origin], cwd=path, check=True, timeout=30)
    return for_agent(path) if give else path


def says(k: Kandev, sid: str, prompt: str) -> str:
    k.cli("prompt", sid, prompt, "--wait")
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


@dataclass
class Guests:
    k: Kandev
    token_file: Path
    sid: str  # session A: a GitHub-backed workspace
    workspace: Path
    other_sid: str  # session B: another task, another workspace (also GitHub-backed)
    other_workspace: Path


@pytest.fixture
def guests(kandev_factory: Any, short_tmp: Path) -> Iterator[Guests]:
    """Two sessions of one home, agent survival on (a detached control server)."""
    yield _guests(kandev_factory, short_tmp, survival=True)


@pytest.fixture
def guests_without_survival(kandev_factory: Any, short_tmp: Path) -> Iterator[Guests]:
    """The same with agent survival off (the control server is the backend's child)."""
    yield _guests(kandev_factory, short_tmp, survival=False)


def _guests(kandev_factory: Any, short_tmp: Path, *, survival: bool) -> Guests:
    token_file = short_tmp / "github-token"
    token_file.write_text(UPSTREAM + "\n")
    token_file.chmod(0o600)
    repo = _repo(short_tmp / "repo", "https://github.com/example/repo.git")
    other = _repo(short_tmp / "other", "https://github.com/example/other.git")
    (other / "private.txt").write_text("another session's work\n")
    k = kandev_factory("home", f'[credentials]\ngithub_token_file = "{token_file}"\n'
                       f'[features]\nagent_survival = {"true" if survival else "false"}\n')
    k.up()
    task = k.cli("task", "create", "--title", "a", "--workspace", str(repo))["task_id"]
    other_task = k.cli("task", "create", "--title", "b", "--workspace", str(other))["task_id"]
    sid = k.cli("session", "start", task)["session_id"]
    other_sid = k.cli("session", "start", other_task)["session_id"]
    k.show(sid), k.show(other_sid)
    return Guests(k, token_file, sid, repo, other_sid, other)


def _attempts(g: Guests) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    k, home = g.k, g.k.home
    st = k.status()
    secrets = sorted(p.name for p in (home / "secrets").iterdir())
    assert any(n.startswith("agentctl-cred-") for n in secrets), secrets
    denied = {
        "token_file": ["cat", str(g.token_file)],
        "store": ["cat", str(home / "kandev.db")],
        "secrets_dir": ["ls", str(home / "secrets")],
        **{f"secret_{i}": ["cat", str(home / "secrets" / n)] for i, n in enumerate(secrets)},
        "run_dir": ["ls", str(home / "run")],
        "logs_dir": ["ls", str(home / "logs")],
        "agentctl_log": ["cat", str(home / "logs" / "agentctl.log")],
        "backend_log": ["cat", str(home / "logs" / "backend.log")],
        "other_workspace": ["cat", str(g.other_workspace / "private.txt")],
        "other_session_dir": ["ls", str(SessionDirs.for_session(home, g.other_sid).root)],
        "other_lease": ["cat", str(SessionDirs.for_session(home, g.other_sid).lease_file)],
        "backend_environ": ["cat", f"/proc/{st['backend']['pid']}/environ"],
        "backend_socket": connect_argv(st["backend"]["socket"]),
        "agentctl_socket": connect_argv(st["control_server"]["endpoint"]),
        "kill_backend": ["kill", "-0", str(st["backend"]["pid"])],
        "kill_agentctl": ["kill", "-0", str(st["control_server"]["pid"])],
        "kill_other_agent": ["kill", "-0", str(k.show(g.other_sid)["agent_pid"])],
        "root_home": ["ls", "/root"],
    }
    allowed = {
        "write_workspace": ["sh", "-c", "echo hi > sandbox-probe.txt && test \"$(cat sandbox-probe.txt)\" = hi"],
        "git": ["git", "status", "--porcelain"],
        "python3": ["python3", "-c", "print(6 * 7)"],
        "own_endpoint": connect_argv(str(SessionDirs.for_session(home, g.sid).endpoint_socket)),
        "own_lease": ["cat", str(SessionDirs.for_session(home, g.sid).lease_file)],
    }
    return denied, allowed


def _attack(g: Guests, sid: str) -> None:
    denied, allowed = _attempts(g)
    said = says(g.k, sid, "/sh " + attack_script(denied, allowed))
    assert said.startswith("sh: exit=0\n"), said
    assert not attack_verdicts(said, denied, allowed), said
    assert says(g.k, sid, "/git-credential").startswith(CREDENTIAL_OK)


def test_scenario_a_an_agent_reaches_its_workspace_and_nothing_of_kandev(guests: Guests) -> None:
    """Issue 10 scenario A, then again once the backend was SIGKILLed and the agent re-tracked
    (survival on): same pid, same start time, the same containment, and git still authenticates
    through the session's endpoint, which the new backend serves again. Issue 19 scenario F: and
    again after a reload of the control server in place (``kandev agentctl reload``)."""
    g, k = guests, guests.k
    before = k.show(g.sid)
    assert (g.workspace / ".git").is_dir()
    _attack(g, g.sid)
    assert (g.workspace / "sandbox-probe.txt").read_text() == "hi\n"  # really written in the workspace

    backend = k.status()["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=30)
    k.up()
    show = wait_until(lambda: s if (s := k.show(g.sid))["retracked"] else None, timeout=60)
    assert (show["agent_pid"], show["agent_pid_start_time"]) == (before["agent_pid"], before["agent_pid_start_time"])
    _attack(g, g.sid)

    server = k.status()["control_server"]["pid"]
    reloaded = k.cli("agentctl", "reload", timeout=200)
    assert reloaded["outcome"] == "reexecuted" and reloaded["pid"] == server
    assert k.show(g.sid)["agent_pid"] == before["agent_pid"]
    _attack(g, g.sid)


def test_issue_19_scenario_f_the_same_containment_without_survival(guests_without_survival: Guests) -> None:
    """Issue 19 scenario F, survival off: every attempt of Issue 10 scenario A fails the same way
    when the control server is the backend's child."""
    g = guests_without_survival
    assert g.k.status()["control_server"]["mode"] == "child"
    _attack(g, g.sid)


def test_scenario_a_a_session_endpoint_serves_its_own_lease_only(guests: Guests) -> None:
    """Issue 10 scenario A: session B's lease (which A's agent cannot even read) checked at session
    A's endpoint is refused; A's own lease checks there. Neither answer holds a credential (Issue 20)."""
    g = guests
    a, b = SessionDirs.for_session(g.k.home, g.sid), SessionDirs.for_session(g.k.home, g.other_sid)
    # The check runs here as the tests' own uid, which reads only a lease file of its own: each
    # agent's lease (of the agents' uid when kandev runs as root) is copied into one of ours.
    b_lease, a_lease = g.k.home.parent / "b-lease.json", g.k.home.parent / "a-lease.json"
    for src, dst in ((b.lease_file, b_lease), (a.lease_file, a_lease)):
        dst.write_bytes(src.read_bytes())
        dst.chmod(0o600)
    with pytest.raises(HelperError) as stolen:
        valid_lease(str(b_lease), str(a.endpoint_socket), "github.com", "example/other.git")
    assert stolen.value.code == "scope_denied" and UPSTREAM not in str(stolen.value)
    assert valid_lease(str(a_lease), str(a.endpoint_socket), "github.com", "example/repo.git")


def test_scenario_a_passthrough_sessions_are_sandboxed_too(guests: Guests) -> None:
    """Issue 10 scenario A for a passthrough session (its control server is always the backend's child)."""
    k = guests.k
    task = k.cli("task", "create", "--title", "passthrough")["task_id"]
    sid = k.cli("session", "start", task, "--passthrough")["session_id"]
    denied = {"store": ["cat", str(k.home / "kandev.db")], "token_file": ["cat", str(guests.token_file)],
              "run_dir": ["ls", str(k.home / "run")]}
    allowed = {"write_workspace": ["sh", "-c", "echo x > f"]}
    said = says(k, sid, "/sh " + attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    uid = sandbox_ids()[0]
    assert uid != 0 and says(k, sid, "/sh id -u") == f"sh: exit=0\n{uid}\n"  # never root inside


def _loose(home: Path) -> list[str]:
    """Everything under the home with a group or other permission bit, but the run dir and CLI socket."""
    out, agent = [], agent_user()
    for dirpath, dirnames, filenames in os.walk(home):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode) or p in (home / "run", home / "run" / "backend.sock"):
                continue
            rel = p.relative_to(home).parts
            if rel[0] == "worktrees" and len(rel) > 2:
                continue  # a workspace's content is the agent's work (its top directory is 0700)
            if rel[0] == "sessions" and rel[-1] == "endpoint" and stat.S_IMODE(st.st_mode) == endpoint_mode(agent):
                continue  # 0711 when its agent is another uid (kandev as root): it reaches the socket in it
            if rel[:2] == ("run", "egress") and len(rel) == 3 and stat.S_IMODE(st.st_mode) == endpoint_mode(agent):
                continue  # a live agent's egress proxy socket directory (Issue 44), the same reason
            if stat.S_IMODE(st.st_mode) & 0o077:
                out.append(f"{p} {stat.S_IMODE(st.st_mode):04o}")
    return out


def test_item_9_the_home_is_private_and_credentials_of_gone_servers_are_removed(kandev_factory: Any) -> None:
    """Issue 10 item 9: after real daemons ran sessions, nothing under the home but the run
    directory and the CLI socket has a group or other bit (backend.log included); each restart of
    the backend (survival off: a new control server each time) leaves only the credential file of
    the server in use."""
    k = kandev_factory()
    for _ in range(3):
        k.up()
        k.start_session("hygiene")
        k.cli("down")
    st = k.up()
    assert (k.home / "logs" / "backend.log").exists()
    creds = sorted(p.name for p in (k.home / "secrets").iterdir() if p.name.startswith("agentctl-cred-"))
    rec = db_row(k, "SELECT credential_ref FROM control_server_record WHERE id = 1")
    assert rec is not None and creds == [rec["credential_ref"]], (creds, rec)
    assert not (k.home / "secrets" / "agentctl-bootstrap").exists()
    assert not _loose(k.home), _loose(k.home)
    assert st["backend"]["state"] == "ready"


# ---------------------------------------------------------------- Issue 10 scenario B


def _path_without_bwrap(root: Path) -> str:
    """A PATH with what the daemons and the mock use (git, sh, python3), and no bwrap."""
    bindir = root / "bin-no-bwrap"
    bindir.mkdir()
    for tool in ("git", "sh", "python3", "env", "cat", "ls", "id"):
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    assert shutil.which("bwrap", path=str(bindir)) is None
    return str(bindir)


def test_scenario_b_no_sandbox_no_agent_then_off_runs_unsandboxed_and_warns(kandev_factory: Any,
                                                                           short_tmp: Path) -> None:
    """Issue 10 scenario B: bwrap is not on the control server's PATH. ``session start`` fails with
    sandbox_unavailable naming the reason and agents.sandbox; the session is FAILED with that
    reason (nothing STARTING, no agent); status and doctor say why. With agents.sandbox = "off" the
    agent starts, unsandboxed, and the control server logs a warning for it."""
    path = _path_without_bwrap(short_tmp)
    k = kandev_factory("home", "", PATH=path)
    k.up()
    task = k.cli("task", "create", "--title", "b")["task_id"]
    proc = k.run("session", "start", task)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "sandbox_unavailable", error
    assert "bwrap (bubblewrap) is not on the PATH" in error["message"] and "agents.sandbox" in error["message"]
    (session,) = k.cli("session", "list")["sessions"]
    show = k.show(session["session_id"])
    assert show["state"] == "FAILED" and not show["agent_pid"] and "not on the PATH" in show["last_error"], show
    assert not [s for s in k.cli("session", "list")["sessions"] if s["state"] == "STARTING"]
    sandbox = k.status()["sandbox"]
    assert sandbox["policy"] == "required" and sandbox["sandboxed"] is False and sandbox["available"] is False
    assert "not on the PATH" in sandbox["reason"] and "sandbox_unavailable" in sandbox["reason"]
    doctor = json.loads(k.run("doctor").stdout)
    check = next(c for c in doctor["checks"] if c["name"] == "sandbox")
    assert not check["ok"] and "not on the PATH" in check["detail"] and "bubblewrap" in check["hint"], check

    k.cli("down")
    k.env["KANDEV_AGENTS_SANDBOX"] = "off"
    k.up()
    sid = k.cli("session", "start", task)["session_id"]
    show = k.show(sid)
    assert show["state"] == "WAITING_FOR_INPUT" and show["agent_pid"]
    assert says(k, sid, "/sh cat " + str(k.home / "installation-id")).startswith("sh: exit=0\n")  # unsandboxed
    log = (k.home / "logs" / "agentctl.log").read_text()
    assert "agent_unsandboxed" in log and sid in log and "WARNING" in log
    sandbox = k.status()["sandbox"]
    assert sandbox["policy"] == "off" and sandbox["sandboxed"] is False and "off" in sandbox["reason"]


def test_scenario_a_a_worktree_agent_commits_through_the_repository_git_dir(kandev_factory: Any,
                                                                          short_tmp: Path) -> None:
    """Issue 10 scenario A for the worktree executor: the worktree's ``.git`` file names a git
    directory inside the repository's ``.git``; the sandbox binds that repository git directory
    (not the repository's working tree), so git in the agent commits, and the commit is in the
    repository, while the repository's own files stay out of view."""
    repo = _repo(short_tmp / "wt-repo", "https://example.invalid/x.git", give=False)
    (repo / "secret-of-the-main-tree.txt").write_text("not the agent's\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "root"], cwd=repo, check=True, timeout=30)
    for_agent(repo / ".git")  # the agent commits into the repository's git directory
    k = kandev_factory()
    k.up()
    task = k.cli("task", "create", "--title", "wt", "--executor", "worktree", "--workspace", str(repo))["task_id"]
    sid = k.cli("session", "start", task)["session_id"]
    denied = {"main_tree": ["cat", str(repo / "secret-of-the-main-tree.txt")]}
    allowed = {"commit": [*git, "commit", "-q", "--allow-empty", "-m", "from the sandbox"],
               "status": ["git", "status", "--porcelain"]}
    said = says(k, sid, "/sh " + attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    # safe.directory: the repository's git directory now belongs to the agents' uid
    log = subprocess.run(["git", "-c", "safe.directory=*", "log", "--format=%s", f"kandev/{task}"], cwd=repo,
                         capture_output=True,
                         text=True, check=True, timeout=30).stdout.split("\n")
    assert log[0] == "from the sandbox"
