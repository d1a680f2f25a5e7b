"""Starting a control server in the lifetime the capability asks for (docs/architecture.md#lifetimes).

Three lifetimes:

- ``unit``: capability enabled under systemd. The server is its own unit,
  ``kandev-agentctl.service``, started through ``systemctl``; it is not
  ``PartOf``/``BindsTo`` the backend, so a backend stop, restart or SIGKILL
  leaves it and its agents running.
- ``detached``: capability enabled with no service manager. A new session,
  no parent-death signal, no liveness pipe, stdio not inherited.
- ``child``: capability disabled (the default) or unavailable. A child of the
  backend in the backend's own cgroup with ``PR_SET_PDEATHSIG``: it dies with
  the backend, as kandev always did (AC-EXECUTORS-SURVIVAL-005.1).

Whoever starts a server writes its launch file (socket path, log path,
installation id, the control server's config keys) and a fresh 32-byte
credential (0600) beforehand; the credential never appears in argv or the
environment. Every launch gets a new socket path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from daemon.agentctl import launch as launch_file
from daemon.agentctl.client.handshake import identify
from daemon.config.settings import Config
from daemon.host.paths import Paths
from daemon.store.states import LaunchMode
from ipc.aio import within

AGENTCTL_UNIT = "kandev-agentctl.service"
BOOTSTRAP_CREDENTIAL = "agentctl-bootstrap"  # LoadCredential= source in the unit
READY_TIMEOUT_S = 30.0
UNIT_SETTLE_TIMEOUT_S = 30.0
_UNIT_BUSY_STATES = ("active", "activating", "reloading", "deactivating")
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """The control server could not be started; the message says why."""


class UnitBusy(LaunchError):
    """kandev-agentctl.service is already running a server this backend did not adopt."""


@dataclass
class ControlServerHandle:
    """A control server this backend is using (started or adopted)."""

    endpoint: str
    mode: str  # a LaunchMode (an adopted server's record gives its value)
    credential_ref: str
    log_path: str | None  # None: an adopted server whose record names no log
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = None  # only while it is our child
    pid_start_time: float | None = None  # psutil create_time of ``pid``, read right after the start
    launch_path: str | None = None  # the launch file this backend wrote for it (None: adopted)


def _start_time(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def agentctl_argv(launch_path: str) -> list[str]:
    # -P: the working directory is not on the server's import path (nor, so, in its agents' sandboxes)
    return [sys.executable, "-P", "-m", "daemon.agentctl.main", "--launch-file", launch_path]


class Launcher:
    """Starts control servers; knows nothing about sessions or recovery."""

    def __init__(self, paths: Paths, config: Config, installation_id: str, mode: LaunchMode) -> None:
        if mode not in tuple(LaunchMode):
            raise ValueError(f"unknown launch mode {mode}")
        self.paths = paths
        self.config = config
        self.installation_id = installation_id
        self.mode = mode

    async def start(self) -> tuple[ControlServerHandle, bytes]:
        """Start a fresh control server and wait until it answers ``identify``."""
        credential = secrets.token_bytes(32)
        credential_ref = f"agentctl-cred-{secrets.token_hex(6)}"
        launch_file.write_credential(self.paths.secrets_dir / credential_ref, credential)
        socket_path = str(self.paths.new_agentctl_socket_path())
        agentctl = self.config.agentctl
        cfg = launch_file.LaunchConfig(
            socket_path=socket_path,
            log_path=str(self.paths.agentctl_log),
            agent_log_dir=str(self.paths.logs_dir / "agents"),
            installation_id=self.installation_id,
            credential_file=str(self.paths.secrets_dir / credential_ref),
            detached_event_limit=agentctl.detached_event_limit,
            unowned_period_s=agentctl.unowned_period,
            idle_timeout_s=agentctl.idle_timeout,
            mode=self.mode,
            # references only (paths, credential names): the server reads the values itself
            agent_secret_env={name: s.secret_refs() for name, s in self.config.agents.settings.items()
                              if s.secret_env},
        )
        handle = ControlServerHandle(
            endpoint=socket_path,
            mode=self.mode,
            credential_ref=credential_ref,
            log_path=str(self.paths.agentctl_log),
        )
        try:
            if self.mode == LaunchMode.UNIT:
                state = (await self._systemctl_state("is-active", AGENTCTL_UNIT)).strip()
                if state in _UNIT_BUSY_STATES:
                    raise UnitBusy(f"{AGENTCTL_UNIT} is {state} with a server this backend did not adopt")
                launch_file.write_credential(self.paths.secrets_dir / BOOTSTRAP_CREDENTIAL, credential)
                launch_path = self.paths.agentctl_dir / "launch.json"
                handle.launch_path = str(launch_path)
                launch_file.dump(cfg, launch_path)
                await self._systemctl("start", AGENTCTL_UNIT)
                handle.pid = await self._unit_main_pid()
            else:
                launch_path = self.paths.agentctl_dir / f"launch-{secrets.token_hex(6)}.json"
                handle.launch_path = str(launch_path)
                launch_file.dump(cfg, launch_path)
                handle.process = self._spawn(str(launch_path))
                handle.pid = handle.process.pid
            handle.pid_start_time = _start_time(handle.pid)
            await self._wait_ready(handle)
        except BaseException as exc:
            # A start that failed leaves nothing behind: no process of ours, no credential, no launch file.
            if handle.process is not None and handle.process.poll() is None:
                handle.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    handle.process.wait(timeout=5)
            if handle.pid is not None and self.mode == LaunchMode.UNIT and not isinstance(exc, asyncio.CancelledError):
                with contextlib.suppress(Exception):
                    await self._systemctl_state("stop", AGENTCTL_UNIT)  # the unit runs a server we cannot use
            self.remove_files(handle)
            raise
        if self.mode == LaunchMode.UNIT:
            # systemd copied it into the unit's credentials when it started the unit, and the server
            # read it from there before it answered: nothing needs the file any more (every start
            # writes a new one; a restart by anyone else fails, as intended).
            (self.paths.secrets_dir / BOOTSTRAP_CREDENTIAL).unlink(missing_ok=True)
        return handle, credential

    def remove_files(self, handle: ControlServerHandle) -> None:
        """Remove what this backend wrote for a server that is gone: its credential, its launch file
        (and the unit's bootstrap copy of the credential) and its socket path, so that repeated
        restarts leave no growing pile. Call it only once the server is known dead."""
        paths = [self.paths.secrets_dir / handle.credential_ref, Path(handle.endpoint)]
        if handle.launch_path:
            paths.append(Path(handle.launch_path))
        if handle.mode == LaunchMode.UNIT and handle.launch_path:
            paths.append(self.paths.secrets_dir / BOOTSTRAP_CREDENTIAL)
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()

    async def wait_unit_settled(self, timeout: float = UNIT_SETTLE_TIMEOUT_S) -> str:
        """Wait (bounded) while systemd is still tearing the control-server unit down after its main
        process died (``deactivating``: the rest of its cgroup is being killed); returns the state."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            state = (await self._systemctl_state("is-active", AGENTCTL_UNIT)).strip()
            if state != "deactivating" or loop.time() >= deadline:
                return state
            await asyncio.sleep(0.1)

    def _spawn(self, launch_path: str) -> subprocess.Popen[bytes]:
        argv = agentctl_argv(launch_path)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID")}
        if self.mode == LaunchMode.CHILD:
            # Dies with the backend, SIGKILL included; its stderr joins ours.
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                preexec_fn=_set_parent_death_signal,
                close_fds=True,
            )
        # Detached: own session, no parent-death signal, no inherited stdio, so no
        # SIGPIPE when we are gone; it logs to its own bounded file.
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            close_fds=True,
        )

    async def _wait_ready(self, handle: ControlServerHandle) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while loop.time() < deadline:
            if handle.process is not None and handle.process.poll() is not None:
                raise LaunchError(
                    f"control server exited with code {handle.process.returncode} before it was ready"
                    f" (see {handle.log_path} or the journal)"
                )
            if await identify(handle.endpoint, timeout=1.0) is not None:
                return
            await asyncio.sleep(0.05)
        raise LaunchError(f"control server did not answer on {handle.endpoint} within {READY_TIMEOUT_S:.0f}s")

    async def _systemctl(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "systemctl",
            *args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            out, err = await within(proc.communicate(), timeout=90)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise LaunchError(f"systemctl {' '.join(args)} timed out") from None
        if proc.returncode != 0:
            raise LaunchError(f"systemctl {' '.join(args)} failed: {err.decode(errors='replace').strip()}")
        return out.decode()

    async def _systemctl_state(self, *args: str) -> str:
        """Like _systemctl, but a non-zero exit (e.g. is-active of an inactive unit) is an answer."""
        proc = await asyncio.create_subprocess_exec(
            "systemctl", *args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        out, _ = await within(proc.communicate(), timeout=90)
        return out.decode()

    async def _unit_main_pid(self) -> int | None:
        out = await self._systemctl("show", "-p", "MainPID", "--value", AGENTCTL_UNIT)
        pid = int(out.strip() or 0)
        return pid or None

    @staticmethod
    async def terminate(handle: ControlServerHandle, timeout: float = 10.0) -> None:
        """Stop a child control server we own (disabled mode shutdown)."""
        proc = handle.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        if not await _exited(proc, timeout):
            proc.kill()
            proc.wait(timeout=5)


async def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether child ``proc`` exited within ``timeout`` (reaped): woken by its exit through a pidfd,
    not by a clock; where pidfds are missing, looked at every 10 ms."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return proc.poll() is not None
    except OSError:
        deadline = loop.time() + timeout
        while proc.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return proc.poll() is not None
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        with contextlib.suppress(TimeoutError):
            await within(gone, timeout)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.poll() is not None
