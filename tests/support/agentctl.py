"""A real control server (``python -m daemon.agentctl.main --launch-file ...``) for tests that
drive it through the real client over its real socket, with the real mock agent.

``write_launch(root)`` lays out a private home (credential, installation id, launch file) and
returns a ``Server``; ``start_server`` starts it in its own session and waits until it answers
``identify``; ``stop_server`` SIGTERMs (then SIGKILLs) it and kills every agent process group the
test saw (``Server.create`` records them). ``root`` must be short: socket paths are limited to 107
bytes (the fixture ``short_tmp`` in tests/integration/conftest.py gives one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.agentctl import auth, launch
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import identify
from tests.support.aio import run
from tests.support.paths import REPO_ROOT
from tests.support.processes import kill_group
from tests.support.workspaces import for_agent

MOCK = [sys.executable, "-m", "daemon.agents.mock"]
STEP = 20.0  # bound on one exchange or one wait, seconds


@dataclass
class Server:
    """One running control server and what a test needs to talk to it."""

    root: Path
    home: Path
    launch_file: Path
    socket_path: str
    log_path: Path
    stderr_path: Path
    credential: bytes
    installation_id: str
    workspace: Path
    mock_state: Path
    proc: subprocess.Popen[bytes] | None = None
    agent_groups: set[int] = field(default_factory=set)

    def connect(self, **kw: Any) -> Awaitable[AgentctlClient]:
        kw.setdefault("credential", self.credential)
        kw.setdefault("installation_id", self.installation_id)
        return AgentctlClient.connect(self.socket_path, **kw)

    async def create(self, client: AgentctlClient, **kw: Any) -> dict[str, Any]:
        kw.setdefault("session_id", "sess-1")
        kw.setdefault("task_id", "task-1")
        kw.setdefault("command", MOCK)
        kw.setdefault("cwd", str(self.workspace))
        kw.setdefault("env", {"KANDEV_MOCK_STATE_DIR": str(self.mock_state), "PYTHONPATH": str(REPO_ROOT)})
        kw.setdefault("agent", "mock")
        # The agent runs in its sandbox (the server's default); the mock keeps its sessions here.
        kw.setdefault("sandbox", {"policy": "required", "writable": [str(self.mock_state)]})
        created = await client.create_instance(**kw)
        self.agent_groups.add(created["pid"])
        return created

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ops_once_ended(self) -> dict[int, list[str]] | None:
        """``ops_by_connection()`` once every connection in it has ended (the -v log says
        ``closed``), so no op of theirs is still to come; None before."""
        text = self.log_text()  # one read for both: a connection's ops are logged before its end
        ops = _ops_by_connection(text)
        ended = {int(m.group(1)) for m in re.finditer(r"conn (\d+) \(pid \d+\) closed", text)}
        return ops if ops and set(ops) <= ended else None

    def ops_by_connection(self) -> dict[int, list[str]]:
        """From the -v log: the ops each connection sent, in order (refused ones included)."""
        return _ops_by_connection(self.log_text())


def _ops_by_connection(log_text: str) -> dict[int, list[str]]:
    ops: dict[int, list[str]] = {}
    for m in re.finditer(r"conn (\d+) \(pid \d+\) op (\w+)", log_text):
        ops.setdefault(int(m.group(1)), []).append(m.group(2))
    return ops


def write_launch(root: Path, **overrides: Any) -> Server:
    """A private home under ``root`` (credential, installation id, launch file; ``overrides`` go
    into the launch file) and the ``Server`` that will run on it, not started yet."""
    home = root / "home"
    home.mkdir(mode=0o700)
    (home / "agentctl").mkdir(mode=0o700)
    workspace = root / "ws"
    workspace.mkdir()
    credential = auth.new_credential()
    cred_file = home / "agentctl" / "credential"
    launch.write_credential(cred_file, credential)
    installation_id = os.urandom(16).hex()
    config = launch.LaunchConfig(
        socket_path=str(home / "run" / "agentctl.sock"),
        log_path=str(home / "logs" / "agentctl.log"),
        agent_log_dir=str(home / "logs" / "agents"),
        installation_id=installation_id,
        credential_file=str(cred_file),
        mode="detached",
    )
    config = launch.from_json({**config.to_json(), **overrides})
    launch_file = home / "agentctl" / "launch.json"
    launch.dump(config, launch_file)
    (root / "mock-state").mkdir(mode=0o700)  # bound read-write into the agents' sandboxes
    for_agent(root / "mock-state")  # both are the agents' (kandev-agent's when the tests run as root)
    for_agent(workspace)
    return Server(
        root=root,
        home=home,
        launch_file=launch_file,
        socket_path=config.socket_path,
        log_path=Path(config.log_path),
        stderr_path=root / "server.stderr",
        credential=credential,
        installation_id=installation_id,
        workspace=workspace,
        mock_state=root / "mock-state",
    )


def server_env() -> dict[str, str]:
    """This environment without kandev's, systemd's notify and credentials variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KANDEV_", "NOTIFY_", "CREDENTIALS_"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def start_server(server: Server, *, stderr: Any = None, env: dict[str, str] | None = None) -> None:
    """Start the server in its own session; return once it answers ``identify`` (``STEP`` at most)."""
    with open(server.stderr_path, "ab") as err:
        server.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.agentctl.main", "--launch-file", str(server.launch_file), "-v"],
            cwd=REPO_ROOT,
            env={**server_env(), **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err if stderr is None else stderr,
            start_new_session=True,
        )

    async def answered() -> bool:
        return await identify(server.socket_path, timeout=1.0) is not None

    deadline = time.monotonic() + STEP
    while not run(answered(), 5):
        if server.proc.poll() is not None:
            raise AssertionError(f"agentctl exited {server.proc.returncode}: {server.stderr_path.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError("agentctl did not answer identify in time")
        time.sleep(0.05)


def stop_server(server: Server) -> None:
    """SIGTERM (SIGKILL after 15 s) the server if it runs, then kill every agent group it had."""
    proc = server.proc
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for pgid in server.agent_groups:
        kill_group(pgid)
