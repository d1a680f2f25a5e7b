"""The home's hygiene pass (daemon/backend/lifetime/hygiene.py), on a real directory tree (Issue 10 item 9).

The integration test tests/integration/test_sandbox.py checks the same on a home the real daemons
made; here every rule gets its own case, loose modes set on purpose."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import pytest

from daemon.backend.lifetime import hygiene
from daemon.backend.lifetime.hygiene import _proven, tidy_home
from daemon.host import session_dirs
from daemon.host.agent_user import AgentUser
from daemon.host.paths import Paths, run_dir_mode
from daemon.host.session_dirs import SessionDirs
from ipc.errors import ErrorCode, IpcError
from ipc.schema import OpTable
from ipc.server import IpcServer


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_everything_private_but_the_run_dir_and_cli_socket(tmp_path: Path) -> None:
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    files = {
        paths.db_path: 0o644, paths.home / "installation-id": 0o640, paths.logs_dir / "backend.log": 0o644,
        paths.logs_dir / "agentctl.log": 0o640, paths.logs_dir / "agents" / "x.stderr.log": 0o644,
        paths.agentctl_dir / "launch.json": 0o640,
        paths.home / "sessions" / "s1" / "agent" / "tool": 0o755,  # an agent's executable keeps its x bit
    }
    for f, m in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x")
        os.chmod(f, m)
    tree = paths.worktrees_dir / "t1"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(tree / "src" / "run.sh", 0o755)
    for d in (paths.logs_dir, paths.logs_dir / "agents", paths.worktrees_dir, tree, paths.home / "sessions",
              paths.home / "sessions" / "s1", paths.home / "sessions" / "s1" / "agent"):
        os.chmod(d, 0o755)
    os.chmod(paths.run_dir, 0o755)
    cli = socket.socket(socket.AF_UNIX)
    cli.bind(str(paths.backend_socket))
    os.chmod(paths.backend_socket, 0o666)
    ctl = socket.socket(socket.AF_UNIX)
    ctl.bind(str(paths.run_dir / "agentctl-1.sock"))
    os.chmod(paths.run_dir / "agentctl-1.sock", 0o660)
    exposed = paths.secrets_dir / "agentctl-cred-exposed"
    exposed.write_text("x")
    os.chmod(exposed, 0o644)  # refused by kandev's readers; must not be made trustworthy again
    outside = tmp_path / "outside"
    outside.write_text("not ours to change")
    os.chmod(outside, 0o644)
    (paths.logs_dir / "link").symlink_to(outside)
    try:
        out = tidy_home(paths, keep_credentials={"agentctl-cred-exposed"})
    finally:
        cli.close()
        ctl.close()
    for f, m in files.items():
        assert mode(f) == m & 0o700, f
    for d in (paths.logs_dir, paths.logs_dir / "agents", paths.worktrees_dir, tree, paths.home / "sessions",
              paths.home / "sessions" / "s1", paths.home / "sessions" / "s1" / "agent", paths.secrets_dir,
              paths.agentctl_dir):
        assert mode(d) == 0o700, d
    assert mode(paths.run_dir) == run_dir_mode()
    assert mode(paths.backend_socket) == 0o660 and mode(paths.run_dir / "agentctl-1.sock") == 0o600
    assert mode(tree / "src" / "run.sh") == 0o755  # a workspace's content is the agent's work, not walked
    assert mode(outside) == 0o644  # a symlink is never followed
    assert mode(exposed) == 0o644  # a loose secret is left loose (and refused), never laundered
    assert out.modes and not out.removed


@pytest.mark.parametrize(("dedicated", "want"), [(True, 0o711), (False, 0o700)])
def test_a_session_endpoint_is_opened_only_to_an_agent_of_another_uid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dedicated: bool, want: int) -> None:
    """Issue 10 item 9: a session's ``endpoint/`` is 0711 only when agents run as another uid
    (kandev as root: the agent reaches its socket in it); under the units agents keep the service
    uid and it is 0700 like the rest of the home, both when made and after the hygiene pass."""
    agent = AgentUser(os.geteuid(), os.getegid(), "agents", dedicated)  # our uid: no chown needed
    monkeypatch.setattr(session_dirs, "agent_user", lambda: agent)
    monkeypatch.setattr(hygiene, "agent_user", lambda: agent)
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    dirs = SessionDirs.for_session(paths.home, "s1").ensure()
    assert mode(dirs.endpoint) == want and mode(dirs.root) == 0o700
    os.chmod(dirs.endpoint, 0o755)
    tidy_home(paths, keep_credentials=set())
    assert mode(dirs.endpoint) == want


def test_credential_files_of_gone_servers_and_the_bootstrap_are_removed(tmp_path: Path) -> None:
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    for name in ("agentctl-cred-aaaa", "agentctl-cred-bbbb", "agentctl-cred-cccc", "agentctl-bootstrap",
                 "github-token-of-someone"):
        (paths.secrets_dir / name).write_text("x")
    out = tidy_home(paths, keep_credentials={"agentctl-cred-bbbb"})
    left = sorted(os.listdir(paths.secrets_dir))
    assert left == ["agentctl-cred-bbbb", "github-token-of-someone"]
    assert sorted(Path(p).name for p in out.removed) == ["agentctl-bootstrap", "agentctl-cred-aaaa",
                                                         "agentctl-cred-cccc"]


def test_a_control_server_re_executing_keeps_every_credential_it_may_hold(tmp_path: Path) -> None:
    """Issue 15 with Issue 10 item 9: a control server answering ``reloading`` (re-executing in place,
    its credentials in memory across the exec) cannot prove what it holds right now: the pass keeps
    every candidate (None) rather than removing a live server's credential; a socket nobody listens
    on proves nothing (empty)."""
    path = tmp_path / "agentctl-1.sock"
    candidates = {"agentctl-cred-a": b"\x01" * 32}

    async def main() -> tuple[set[str] | None, set[str] | None]:
        server = IpcServer(str(path), OpTable("kandev-agentctl", (1, 1), []), {})
        await server.start()
        server.refuse_new_requests(IpcError(ErrorCode.RELOADING, "the control server is re-executing"))
        try:
            reloading = await _proven(path, candidates, "installation")
        finally:
            await server.close()
        return reloading, await _proven(path, candidates, "installation")

    assert asyncio.run(main()) == (None, set())
