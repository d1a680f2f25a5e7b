"""Driving one Kandev home through the real CLI, and reading what it left behind.

``Kandev`` runs the real ``kandev`` CLI (``python -m daemon.cli``) against a private home with a
chosen environment, remembers every backend, control server and agent pid it saw, and ``cleanup()``
stops what it started: ``kandev down``, then SIGTERM/SIGKILL of exactly those pids and process
groups. ``cli``/``run`` add ``--json``; ``human`` runs a command as a person would (no ``--json``);
``popen`` starts one that keeps running (``follow``). The fixture ``kandev_factory``
(tests/integration/conftest.py) makes them. ``db_row``/``db_rows`` read the home's SQLite store
read-only; ``mock_agents`` finds every mock agent of a home, orphans included.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from tests.support.paths import REPO_ROOT
from tests.support.processes import alive, cmdline, terminate
from tests.support.waiting import wait_until

TASK_DUMP = "task dump requested (SIGUSR1)"


class CliError(RuntimeError):
    """A ``kandev`` command that exited non-zero, with its exit code and output."""

    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        super().__init__(f"kandev exited {code}: {stderr.strip()} {stdout.strip()}")
        self.code = code
        self.stdout = stdout
        self.stderr = stderr


class Kandev:
    """Drives one Kandev home through the real CLI."""

    def __init__(self, home: Path, env: dict[str, str]) -> None:
        self.home = home
        self.env = env
        self.cwd = REPO_ROOT  # where the CLI (and so the backend it starts) runs; `-m` puts it first on sys.path
        self.backend_pids: set[int] = set()
        self.server_pids: set[int] = set()
        self.agent_pids: set[int] = set()
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [sys.executable, "-m", "daemon.cli", "--home", str(self.home), "--json", *args],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                cwd=self.cwd,
            )
        except subprocess.TimeoutExpired:
            self.print_task_dumps()  # shown with the failure: what each daemon was waiting on
            raise

    def human(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
        """The CLI as a person runs it (no --json), stdout a pipe; ``env`` adds variables."""
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli", "--home", str(self.home), *args],
            capture_output=True, text=True, env={**self.env, **env}, timeout=timeout, cwd=REPO_ROOT,
        )

    def popen(self, *args: str, json_output: bool = False, **env: str) -> subprocess.Popen[bytes]:
        """A CLI command that keeps running (e.g. ``follow``), stdout and stderr pipes; stopped at
        teardown if still running."""
        argv = [sys.executable, "-m", "daemon.cli", "--home", str(self.home)]
        proc = subprocess.Popen(
            [*argv, *(["--json"] if json_output else []), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**self.env, **env}, cwd=REPO_ROOT,
        )
        self.procs.append(proc)
        return proc

    def print_task_dumps(self) -> None:
        """SIGUSR1 to each daemon this home started; print the task dump each one logged."""
        logs = self.home / "logs"
        for pids, log in ((self.backend_pids, logs / "backend.log"), (self.server_pids, logs / "agentctl.log")):
            for pid in sorted(pids):
                if not alive(pid) or str(self.home) not in " ".join(cmdline(pid)):
                    continue  # gone, or the pid is another process's now
                before = log.read_text(errors="replace").count(TASK_DUMP) if log.exists() else 0
                os.kill(pid, signal.SIGUSR1)
                try:
                    text = wait_until(lambda log=log, before=before: t if (t := log.read_text(errors="replace"))
                                      .count(TASK_DUMP) > before else None, timeout=10)
                except TimeoutError:
                    print(f"--- pid {pid} logged no task dump within 10 s")
                    continue
                print(f"--- task dump of pid {pid} ({log.name})\n{text[text.rindex(TASK_DUMP):][-20000:]}")

    def cli(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        proc = self.run(*args, timeout=timeout)
        if proc.returncode != 0:
            raise CliError(proc.returncode, proc.stdout, proc.stderr)
        return json.loads(proc.stdout)

    def up(self) -> dict[str, Any]:
        out = self.cli("up", timeout=450)
        st = out["status"]
        self.backend_pids.add(int(st["backend"]["pid"]))
        if st["control_server"]["pid"]:
            self.server_pids.add(int(st["control_server"]["pid"]))
        return st

    def status(self) -> dict[str, Any]:
        return self.cli("status")

    def show(self, session_id: str) -> dict[str, Any]:
        show = self.cli("session", "show", session_id)
        if show.get("agent_pid"):
            self.agent_pids.add(int(show["agent_pid"]))
        return show

    def transcript(self, session_id: str) -> list[dict[str, Any]]:
        """The session's whole transcript, paged with ``session show --after-seq`` (more than one
        page holds), each entry once and in cursor order."""
        entries: list[dict[str, Any]] = []
        cursor = 0
        while True:
            show = self.cli("session", "show", session_id, "--after-seq", str(cursor), "--limit", "10000")
            entries += show["transcript"]
            if not show["page"]["more_after"]:
                return entries
            cursor = show["page"]["next_cursor"]

    def start_session(self, title: str = "t", *extra: str) -> tuple[str, str]:
        task = self.cli("task", "create", "--title", title)["task_id"]
        sid = self.cli("session", "start", task, *extra)["session_id"]
        self.show(sid)
        return task, sid

    @property
    def backend_pid(self) -> int:
        return int(self.status()["backend"]["pid"])

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self.run("down", timeout=60)
        for pid in sorted(self.backend_pids | self.server_pids):
            terminate(pid)
        for pid in sorted(self.agent_pids):
            terminate(pid, group=True)


def make_env(config: Path, **overrides: str) -> dict[str, str]:
    """The environment of a home's CLI: this one without kandev's and systemd's variables, the
    config file ``config`` (never the host's /etc/kandev), ``overrides`` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KANDEV_")}
    env.pop("NOTIFY_SOCKET", None)
    env.pop("INVOCATION_ID", None)
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["KANDEV_CONFIG"] = str(config)  # never read the host's /etc/kandev
    env.update(overrides)
    return env


def mock_agents(home: Path) -> set[int]:
    """Pids of every live mock agent started for this Kandev home (its environment names the mock
    state directory of one of the home's sessions), whoever started it: finds orphans no session
    accounts for. An agent is counted by its process-group leader, the pid a session shows: the
    sandbox's bwrap (whose argv and environment are the mock's too), or the mock itself."""
    state_dir = str(home / "sessions") + os.sep
    found: set[int] = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "daemon.agents.mock" not in " ".join(proc.info["cmdline"] or []):
                continue
            if proc.status() == psutil.STATUS_ZOMBIE or os.getpgid(proc.pid) != proc.pid:
                continue
            if (proc.environ().get("KANDEV_MOCK_STATE_DIR") or "").startswith(state_dir):
                found.add(proc.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def db_row(k: Kandev, sql: str, *params: Any) -> dict[str, Any] | None:
    """One row of this home's SQLite store, read-only (None if the query returns nothing)."""
    con = sqlite3.connect(f"file:{k.home / 'kandev.db'}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        row = con.execute(sql, params).fetchone()
        return dict(row) if row else None
    finally:
        con.close()


def db_rows(k: Kandev, sql: str, *params: Any) -> list[dict[str, Any]]:
    """Every row of a query on this home's SQLite store, read-only (for what session show would
    return in one frame too large, e.g. tens of thousands of chunks)."""
    con = sqlite3.connect(f"file:{k.home / 'kandev.db'}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in con.execute(sql, params).fetchall()]
    finally:
        con.close()


def mock_state_file(k: Kandev, name: str) -> Path:
    """A file the mock agent persisted (``<acp session>.json`` / ``.history.jsonl``): the mock keeps
    its state in its session's own state directory, ``<home>/sessions/<sid>/agent/mock-sessions``."""
    found = sorted(k.home.glob(f"sessions/*/agent/mock-sessions/{name}"))
    assert len(found) <= 1, found
    return found[0] if found else k.home / "sessions" / "?" / "agent" / "mock-sessions" / name


def logged_problems(k: Kandev) -> str:
    """The last warnings and errors both daemons of ``k`` logged (shown with a failure)."""
    lines = []
    for name in ("backend.log", "agentctl.log"):
        path = k.home / "logs" / name
        if path.exists():
            lines += [f"{name}: {line[:400]}" for line in path.read_text(errors="replace").splitlines()
                      if " WARNING " in line or " ERROR " in line]
    return "\n".join(lines[-60:])
