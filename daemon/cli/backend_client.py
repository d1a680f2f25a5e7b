"""The backend as the ``kandev`` CLI sees it: one call on its socket (``call``), and starting and
stopping it (``kandev up``: start one when none runs, after checking the configuration it would
refuse, or ask a running one to retry a control server it gave up on; ``kandev down``: stop it,
with its agents on request, even when only a detached control server is left). Imported by every
command: the heavier modules (subprocess, the configuration) only inside ``up``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from daemon.api.ops import BackendState, LinkState
from daemon.cli.call import call
from ipc.errors import ErrorCode, IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from daemon.host.paths import Paths

UP_TIMEOUT_S = 400.0  # covers the longest accepted recovery deadline (5 min) plus start-up
DOWN_TIMEOUT_S = 60.0
UP_POLL_S = 0.02  # how often ``up`` asks a starting backend whether it is ready (one status call)
WAITING = (BackendState.OUT_OF_SPACE, BackendState.STORE_UNREACHABLE)
"""A backend up and serving ``status`` while it waits to open its store (``kandev status`` says why)."""


def _reachable(socket: str | Path) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = call(socket, "status", timeout=5.0)
        return status
    except IpcError:
        return None


def _gave_up(status: dict[str, Any]) -> list[str]:
    """Which control servers the backend gave up restarting (they kept dying)."""
    server = status.get("control_server") or {}
    links = [("survival", server), ("passthrough", server.get("passthrough") or {})]
    return [name for name, link in links if link.get("state") == LinkState.GAVE_UP]


def _retry_control_server(paths: Paths, status: dict[str, Any]) -> dict[str, Any]:
    """The backend runs but gave up on a control server: ask it to try again and wait for the outcome
    (running, or gave up again after its crash-loop limit)."""
    call(paths.backend_socket, "control_server_retry", timeout=10.0)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        status = call(paths.backend_socket, "status", timeout=10.0)
        server = status["control_server"]
        states = {server["state"], (server.get("passthrough") or {}).get("state")}
        if LinkState.GAVE_UP in states:
            loss = (server.get("gave_up") or (server.get("passthrough") or {}).get("gave_up") or {})
            raise IpcError("control_server_gave_up", "the control server still dies at start; the backend gave"
                           f" up again: {loss.get('reason', 'unknown reason')}")
        if not states & {LinkState.LOST, LinkState.RESTARTING}:
            return {"started": False, "retried": True, "pid": status["backend"]["pid"], "status": status}
        time.sleep(0.1)
    raise IpcError(ErrorCode.TIMEOUT, f"the control server did not come back within {UP_TIMEOUT_S:.0f}s")


def _check_config(config_path: str | None) -> None:
    """What the backend would refuse at start, refused here first, naming file, key, value, range."""
    from daemon.config.keys import ConfigError
    from daemon.config.settings import check_config, config_file

    try:
        check_config(config_path)
    except ConfigError as exc:
        raise IpcError("config_refused", f"the configuration is refused, nothing was started: {exc}",
                       details={"file": config_file(config_path), "key": exc.key}) from None


def _same_config(status: dict[str, Any], config_path: str | None) -> None:
    """``up --config X`` against a backend that runs with another configuration: say so."""
    backend = status.get("backend") or {}
    if config_path is None or "config" not in backend:  # no --config, or a backend too old to say
        return
    running = backend.get("config")
    if running is not None and os.path.realpath(running) == os.path.realpath(config_path):
        return
    raise IpcError("config_mismatch", f"a backend already runs (pid {backend.get('pid')}) with"
                   f" {running or 'no configuration file (defaults)'}; --config {config_path} was not applied",
                   details={"running": running, "given": config_path})


SURVIVAL_ENV = "KANDEV_FEATURES_AGENT_SURVIVAL"


def _same_survival(status: dict[str, Any], survival: bool) -> None:
    """``up --survival`` against a backend that runs without it: say so (it takes effect at a start)."""
    cap = status.get("capability") or {}
    if not survival or cap.get("state") in ("enabled", None):
        return
    pid = (status.get("backend") or {}).get("pid")
    if cap.get("state") == "unavailable":
        raise IpcError("survival_unavailable", f"a backend already runs (pid {pid}) and agent survival is unavailable"
                       f" here ({cap.get('reason')}): {cap.get('detail')}", details={"capability": cap})
    raise IpcError("survival_mismatch", f"a backend already runs (pid {pid}) with agent survival off; --survival"
                   " was not applied: kandev down, then kandev up --survival (the running agents stop with it)",
                   details={"capability": cap})


def _this_start(log_path: Path, offset: int) -> list[str]:
    """The lines the backend wrote to its log since ``offset``: this start's, not earlier runs'."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read(64 * 1024).decode("utf-8", errors="replace")
    return [line for line in text.splitlines() if line.strip()][-8:]


def cmd_up(paths: Paths, args: argparse.Namespace) -> dict[str, Any]:
    status = _reachable(paths.backend_socket)
    if status is not None and status["backend"]["state"] in WAITING:
        return {"started": False, "pid": status["backend"]["pid"], "status": status}
    survival = bool(getattr(args, "survival", False))
    if status is not None and status["backend"]["state"] == BackendState.READY:
        _same_config(status, args.config)
        _same_survival(status, survival)
        if _gave_up(status):
            return _retry_control_server(paths, status)
        return {"started": False, "pid": status["backend"]["pid"], "status": status}
    log_path = paths.logs_dir / "backend.log"
    offset = 0
    if status is None:
        import subprocess

        if survival:  # the backend reads it as it reads features.agent_survival, over the file
            os.environ[SURVIVAL_ENV] = "true"
        _check_config(args.config)
        paths.ensure()
        argv = [sys.executable, "-m", "daemon.backend.main", "--home", str(paths.home)]
        if args.config:
            argv += ["--config", args.config]
        # private like everything under the home (it may hold session ids, paths, errors)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
        offset = os.fstat(fd).st_size
        with open(fd, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
    else:
        _same_config(status, args.config)
        _same_survival(status, survival)
        proc = None
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            lines = _this_start(log_path, offset)
            raise IpcError("backend_exited", f"the backend exited with code {proc.returncode} at start:\n"
                           + "\n".join(f"  {line}" for line in lines or ["(it wrote nothing)"]))
        status = _reachable(paths.backend_socket)
        # up and serving, or up and waiting to open its store (for space, for its database server: status says so)
        if status is not None and (status["backend"]["state"] == BackendState.READY
                                   or status["backend"]["state"] in WAITING):
            return {"started": True, "pid": status["backend"]["pid"], "status": status}
        time.sleep(UP_POLL_S)
    raise IpcError(ErrorCode.TIMEOUT, f"backend did not become ready within {UP_TIMEOUT_S:.0f}s")


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the service user's backend: ask /proc instead
        return not os.path.exists(f"/proc/{pid}")
    return False


def _wait_exit(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` exited within ``timeout``: woken by its exit (a pidfd), not by a clock."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd here: look often
        deadline = time.monotonic() + timeout
        while not _exited(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def _control_server_sockets(paths: Paths) -> list[Path]:
    """Control-server sockets of the home that something listens on (a detached server without a
    backend, after ``kandev down`` with survival on)."""
    import socket as socket_mod

    found = []
    for path in sorted(paths.run_dir.glob("agentctl-*.sock")) if paths.run_dir.is_dir() else []:
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(str(path))
            except OSError:
                continue
        found.append(path)
    return found


def cmd_down(paths: Paths, args: argparse.Namespace) -> dict[str, Any]:
    try:
        status = call(paths.backend_socket, "status", timeout=10.0)
    except IpcError as exc:
        if exc.code != ErrorCode.UNAVAILABLE:
            raise
        if not (args.agents and _control_server_sockets(paths)):
            return {"stopped": False, "running": False, "home": str(paths.home)}
        # A detached control server outlived its backend: a backend adopts it (proving it owns it),
        # then stops it with its agents.
        print("kandev: no backend runs, but a detached control server does: starting the backend to stop it"
              " and its agents", file=sys.stderr, flush=True)
        status = cmd_up(paths, argparse.Namespace(config=None, survival=False))["status"]
    pid = int(status["backend"]["pid"])
    result = call(paths.backend_socket, "shutdown", {"agents": True} if args.agents else {}, timeout=10.0)
    agents = result.get("agents")
    if args.agents:
        print(f"kandev: stopping the backend (pid {pid}), its control server and its"
              f" {agents if agents is not None else 'every'} agent{'' if agents == 1 else 's'}",
              file=sys.stderr, flush=True)
    if _wait_exit(pid, DOWN_TIMEOUT_S):
        return {"stopped": True, "running": True, "pid": pid, "detached": bool(result.get("detach")),
                "agents": agents, "turns": result.get("turns"), "survival": result.get("survival")}
    raise IpcError(ErrorCode.TIMEOUT, f"backend pid {pid} did not exit within {DOWN_TIMEOUT_S:.0f}s")
