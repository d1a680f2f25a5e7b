"""``kandev-agentctl --reload``: have the running control server re-execute, and wait for the outcome.

This is what the unit's ``ExecReload=`` runs (``systemctl reload kandev-agentctl``;
the unit passes ``--pid $MAINPID``), and what an operator may run by hand with
the server's home. It needs no credential: it checks with the unauthenticated
``identify`` that a server answers on the socket the launch file names and can
reload (capability ``reload.v1``), sends SIGHUP to its pid (so it must run as the
server's user or root), and follows the 0600 status file the server keeps beside
its socket (``<socket>.reload.json``: pid, version, reload history) until the
attempt it started has an outcome. A reload takes the time to quiesce, preflight
and start the new image (a second or two); ``systemctl reload`` returns when it
is done, so a package upgrade can restart the backend knowing which code the
server runs.

Exit codes: 0 re-executed; 1 refused (the reason is printed and in the journal,
``KANDEV_EVENT=reload_refused``: the old code keeps serving); 2 no server or bad
arguments; 3 the server predates in-place reload (release 0.1.0): it keeps its
agents and the backend replaces it once it runs none; 4 no outcome in time.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from daemon.agentctl import launch
from daemon.agentctl.protocol import RELOAD_CAPABILITY, VERSION
from ipc.errors import IpcError
from ipc.sync_client import SyncClient

EXIT_REEXECUTED, EXIT_REFUSED, EXIT_NO_SERVER, EXIT_CANNOT_RELOAD, EXIT_TIMEOUT = 0, 1, 2, 3, 4
POLL_S = 0.1
DEFAULT_TIMEOUT_S = 80.0  # under the default 90 s systemd gives ExecReload=
STATUS_SUFFIX = ".reload.json"  # AgentctlServer.reload_status_path


def _say(message: str) -> None:
    print(f"kandev-agentctl: {message}", file=sys.stderr, flush=True)


def identify(socket_path: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """The server's identify answer, or None if nothing answers (e.g. while it re-executes)."""
    try:
        with SyncClient(socket_path, protocol_major=VERSION[0], timeout=timeout, hello=False) as client:
            info = client.call("identify", timeout=timeout)
    except (IpcError, OSError):
        return None
    return info if isinstance(info, dict) else None


def read_status(socket_path: str) -> dict[str, Any] | None:
    """The server's reload status file, or None if it is missing or being replaced."""
    try:
        doc = json.loads(Path(socket_path + STATUS_SUFFIX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("reload"), dict) else None


def run(launch_path: Path, *, pid: int | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    try:
        config = launch.load(launch_path)
    except launch.LaunchError as exc:
        _say(f"cannot reload: {exc}")
        return EXIT_NO_SERVER
    info = identify(config.socket_path)
    if info is None:
        _say(f"cannot reload: no control server answers on {config.socket_path}")
        return EXIT_NO_SERVER
    if RELOAD_CAPABILITY not in (info.get("capabilities") or []):
        _say("the running control server predates in-place reload (release 0.1.0): it keeps serving its agents"
             " and the backend replaces it once it runs none")
        return EXIT_CANNOT_RELOAD
    before = read_status(config.socket_path)
    server_pid = before.get("pid") if before else None
    if not isinstance(server_pid, int) or (pid is not None and pid != server_pid):
        _say(f"cannot reload: the server on {config.socket_path} reports pid {server_pid}, not {pid}")
        return EXIT_NO_SERVER
    history = before["reload"] if before else {}
    # A reload already running when our signal arrives is the one we wait for.
    last_attempt = int(history.get("attempts") or 0) - (1 if history.get("in_progress") else 0)
    try:
        os.kill(server_pid, signal.SIGHUP)
    except OSError as exc:
        _say(f"cannot signal pid {server_pid}: {exc.strerror or exc}")
        return EXIT_NO_SERVER
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        now = read_status(config.socket_path)
        if now is None or now.get("pid") != server_pid:
            continue
        status = now["reload"]
        if int(status.get("last_attempt") or 0) <= last_attempt or status.get("in_progress"):
            continue
        if status.get("last_outcome") == "reexecuted":
            print(f"control server pid {server_pid} re-executed: version {status.get('last_from_version')}"
                  f" -> {now.get('version')} (re-execution {status.get('reexec_count')},"
                  f" serving again after {status.get('last_pause_ms')} ms)", flush=True)
            return EXIT_REEXECUTED
        _say(f"reload refused: {status.get('last_reason')}; version {now.get('version')} keeps serving")
        return EXIT_REFUSED
    _say(f"no outcome of the reload within {timeout:g} s")
    return EXIT_TIMEOUT
