"""Reload: replace the control server's code in place, every agent keeps running (Issue 15).

Like ``systemctl daemon-reexec``. Triggered by SIGHUP (the unit's ``ExecReload=``
runs ``kandev-agentctl --reload``, which sends it and waits for the outcome) or
by the authenticated ``reload`` op (``kandev agentctl reload``, through the
backend). One reload at a time; a request during one joins it.

1. Quiesce the IPC side: every new request is answered ``reloading`` (it never
   ran, so the client sends it again later); the requests already running finish
   and their answers are written (bounded by ``QUIESCE_TIMEOUT_S``); the
   listening socket stops being served but stays open (peers that connect wait
   in its backlog); every connection is closed after what was written to it, a
   call connection with a last ``reloading`` frame. A backend's stream ends at a
   frame boundary and the backend attaches again with ``after_seq``.
2. Quiesce the agents: each connection stops reading at a message boundary (a
   line being read, or held back by the detached bound, stays in the transport),
   then waits until every write to the agent is on its way, the open turn's
   prompt is out, and the only agent requests we have not answered are permission
   requests nobody answered yet (``instance_handover.blocker``). No agent-log
   thread work is in flight (``server.background_io``).
3. Capture (``AgentctlServer.capture_handover``) into a sealed memfd, and
   **preflight**: the installed code (``python -m daemon.agentctl.main
   --preflight``, ``daemon.agentctl.reload.preflight``) runs in a subprocess, started
   before step 1 so that importing everything the server runs costs no pause; it
   is then given the captured state and parses it. Only if it succeeds, and loads
   its code from where this process does, does the reload go on. Whatever
   changed meanwhile (an agent exited) is captured again and preflighted again.
4. Exec: the listening socket, the agents' pipes and the memfd are made
   inheritable, SIGTERM/SIGINT/SIGHUP are blocked (a stop that arrives now stays
   pending across the exec and is handled by the new image), and ``execv`` runs
   the installed entry point with ``--resume-state-fd N`` (``daemon.agentctl.reload.resume``).
   Same pid: the agents' parent never changed, so ``PR_SET_PDEATHSIG`` does not
   fire (agents are spawned from the main thread, which is the one that execs).

A refusal at any step (a request that does not finish, an agent that does not
read its stdin, a failed preflight, an exec error) undoes the quiesce: the old
code goes on serving, the journal says why (``KANDEV_EVENT=reload_refused``,
``REASON=``) and ``server_info`` and the status file beside the socket report it
(``reload.last_outcome = "refused"``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import daemon
from daemon.agentctl.handover import encode, write_memfd
from daemon.core.journal import log_event
from daemon.core.version import VERSION, installed_version
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.agentctl.reexec")

QUIESCE_TIMEOUT_S = 15.0
"""Running requests must finish, and writes to agents settle, within this; else the reload is refused."""
CLOSE_TIMEOUT_S = 2.0
"""Connections get this long to take what was written to them before they are aborted."""
PREFLIGHT_TIMEOUT_S = 60.0
CAPTURE_ATTEMPTS = 3
"""Captures (each preflighted) before giving up on a state that keeps changing."""
ENTRY_MODULE = "daemon.agentctl.main"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_REFUSAL_TEXT_LIMIT = 600


class ReloadRefused(Exception):
    """The reload does not happen; ``reason`` says why (journal, server_info)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def code_root() -> str:
    """The directory this process loads kandev's code from (the one holding ``daemon/``)."""
    return str(Path(daemon.__file__).resolve().parent.parent)


def interpreter_flags(orig_argv: list[str] | None = None) -> list[str]:
    """The interpreter options this process was started with (``-P``, ``-X dev``...), to start the
    next image the same way."""
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    flags: list[str] = []
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            break
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            flags.extend(argv[i:i + 2])
            i += 2
            continue
        flags.append(arg)
        i += 1
    return flags


def entry_argv(*args: str) -> list[str]:
    """How to run the installed control server: this interpreter, its options, ``-m`` the entry module."""
    flags = interpreter_flags()
    if "-P" not in flags:  # the working directory never on the import path (see agentctl_argv)
        flags.append("-P")
    return [sys.executable, *flags, "-m", ENTRY_MODULE, *args]


class Reloader:
    """Runs reloads of one server (see the module docstring)."""

    def __init__(
        self,
        server: Any,
        *,
        notify: Callable[[str], None],
        stop_requested: Callable[[], bool],
        extra_args: tuple[str, ...] = (),
        preflight_argv: Callable[[], list[str]] | None = None,
    ) -> None:
        self.server = server
        self._notify = notify
        self._stop_requested = stop_requested
        self._extra_args = extra_args
        self._preflight_argv = preflight_argv or (lambda: entry_argv("--preflight"))
        self._task: asyncio.Task[None] | None = None
        self._busy = False
        self.idle = asyncio.Event()
        self.idle.set()

    @property
    def in_progress(self) -> bool:
        return self._busy

    def request(self, origin: str) -> int:
        """Start a reload, or join the one in progress; returns its attempt number."""
        history = self.server.reload_history
        if self.in_progress:
            attempts: int = history.attempts
            return attempts
        if self.server.shutting_down:
            raise IpcError(ErrorCode.SHUTTING_DOWN, "reload: the control server is shutting down")
        history.attempts += 1
        attempt: int = history.attempts
        self._busy = True
        self.idle.clear()
        self._task = asyncio.get_running_loop().create_task(self._run(attempt, origin), name="agentctl.reload")
        self.server.write_reload_status()  # in progress
        return attempt

    async def _run(self, attempt: int, origin: str) -> None:
        try:
            await self._reload(attempt, origin)
        except ReloadRefused as exc:
            self._refused(attempt, exc.reason)
        except Exception as exc:
            log.exception("reload %d failed", attempt)
            self._refused(attempt, f"internal error: {exc}")
        finally:
            self._busy = False
            self.idle.set()
            self.server.write_reload_status()

    def _refused(self, attempt: int, reason: str) -> None:
        history = self.server.reload_history
        history.last_attempt = attempt
        history.last_outcome = "refused"
        history.last_reason = reason[:_REFUSAL_TEXT_LIMIT]
        history.last_outcome_at = time.time()
        installed = installed_version()
        log_event(
            "reload_refused",
            f"reload {attempt} refused: {reason}; still serving with version {VERSION} (installed: {installed})",
            priority=3,
            REASON=reason[:_REFUSAL_TEXT_LIMIT],
            ATTEMPT=attempt,
            VERSION=VERSION,
            INSTALLED_VERSION=installed or "unknown",
            SERVER_IDENTITY=self.server.server_identity,
        )

    def _check_still_wanted(self) -> None:
        if self.server.shutting_down or self._stop_requested():
            raise ReloadRefused("the control server is stopping")

    async def _reload(self, attempt: int, origin: str) -> None:
        from daemon.agentctl.reload import instance_handover  # imported late, as main imports the server

        server = self.server
        ipc = server.ipc
        self._check_still_wanted()
        log_event("agentctl_reloading", f"reload {attempt} ({origin}): preflight of the installed code, then"
                  f" quiescing {len(server.instances)} instance(s) to re-execute it", ATTEMPT=attempt,
                  VERSION=VERSION, INSTANCES=len(server.instances))
        preflight: _Preflight | None = await _Preflight.start(self._preflight_argv())  # the slow part, unquiesced
        # From here every refusal sends READY=1 again (systemd waits for it after RELOADING=1).
        self._notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
                     "\nSTATUS=re-executing")
        quiesced_at = time.monotonic()
        deadline = quiesced_at + QUIESCE_TIMEOUT_S
        listener = None
        paused: list[Any] = []
        io_held = False
        ipc.refuse_new_requests(IpcError(ErrorCode.RELOADING, "the control server is re-executing; send the"
                                         " request again once it serves (it did not run)"))
        try:
            if not await ipc.wait_handlers(QUIESCE_TIMEOUT_S):
                raise ReloadRefused(f"requests still running after {QUIESCE_TIMEOUT_S:g} s")
            listener = ipc.stop_accepting()
            await ipc.close_connections(IpcError(ErrorCode.RELOADING, "the control server is re-executing:"
                                                 " connect again"), CLOSE_TIMEOUT_S)
            await within(server.background_io.acquire(), max(0.1, deadline - time.monotonic()))
            io_held = True
            paused = list(server.instances.values())
            stopped = [task for inst in paused if (task := instance_handover.pause(inst)) is not None]
            if stopped:
                await asyncio.wait(stopped)
            memfd = -1
            try:
                data = await self._settled_capture(listener, quiesced_at, attempt, deadline)
                for _ in range(CAPTURE_ATTEMPTS):
                    memfd = write_memfd(data)
                    if preflight is None:
                        preflight = await _Preflight.start(self._preflight_argv())
                    report = await preflight.check(data)
                    preflight = None
                    again = await self._final_capture(listener, quiesced_at, attempt, deadline)
                    if again == data:
                        self._exec(memfd, listener, report)  # returns only by raising
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
                    os.close(memfd)
                    memfd = -1
                    data = again
                raise ReloadRefused(f"the state kept changing over {CAPTURE_ATTEMPTS} preflights")
            finally:
                if memfd >= 0:
                    os.close(memfd)
        except TimeoutError:
            raise ReloadRefused(f"the server did not quiesce within {QUIESCE_TIMEOUT_S:g} s") from None
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            if preflight is not None:
                await preflight.abandon()
            for inst in paused:
                instance_handover.resume_after_refusal(inst)
            if io_held:
                server.background_io.release()
            if listener is not None:
                await ipc.resume_accepting(listener)
            ipc.refuse_new_requests(None)
            self._notify(f"READY=1\nSTATUS=serving {len(server.instances)} instance(s) (reload refused)")
            raise

    async def _settle(self, deadline: float) -> None:
        """Wait until every instance can be captured as it is (``instance_handover.blocker``)."""
        while True:
            self._check_still_wanted()
            blocker = self._blocker()
            if blocker is None:
                return
            if time.monotonic() >= deadline:
                raise ReloadRefused(f"{blocker} after {QUIESCE_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)

    def _blocker(self) -> str | None:
        from daemon.agentctl.reload import instance_handover  # imported late, as main imports the server

        for inst in self.server.instances.values():
            blocker: str | None = instance_handover.blocker(inst)
            if blocker is None:
                blocker = _reaped_unseen(inst)
            if blocker is not None:
                return blocker
        return None

    async def _settled_capture(self, listener: Any, quiesced_at: float, attempt: int, deadline: float) -> bytes:
        await self._settle(deadline)
        return encode(self.server.capture_handover(listen_fd=listener.fileno(), quiesced_at=quiesced_at,
                                                   attempt=attempt))

    async def _final_capture(self, listener: Any, quiesced_at: float, attempt: int, deadline: float) -> bytes:
        """A capture taken with the stop signals blocked, after letting pending signal callbacks
        run: from here to the exec nothing awaits, so it is exactly what the new image gets."""
        await self._settle(deadline)
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            for _ in range(3):  # a stop signal that arrived just before the block is handled now
                await asyncio.sleep(0)
            self._check_still_wanted()
            blocker = self._blocker()
            if blocker is not None:
                raise ReloadRefused(f"{blocker} (changed at the last moment)")
            return encode(self.server.capture_handover(listen_fd=listener.fileno(), quiesced_at=quiesced_at,
                                                       attempt=attempt))
        except BaseException:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            raise

    def _exec(self, memfd: int, listener: Any, report: dict[str, Any]) -> None:
        """Replace this process image (stop signals are blocked by ``_final_capture``). Returns
        only by raising ReloadRefused, after undoing what it did."""
        from daemon.agentctl.reload import instance_handover  # imported late, as main imports the server

        server = self.server
        fds = [memfd, listener.fileno()]
        for inst in server.instances.values():
            fds.extend(instance_handover.fds(inst))
        argv = entry_argv(*self._extra_args, "--resume-state-fd", str(memfd))
        log_event(
            "agentctl_reexec",
            f"re-executing control server {server.server_identity}: version {VERSION} -> {report.get('version')},"
            f" {len(server.instances)} instance(s) handed over",
            FROM_VERSION=VERSION,
            TO_VERSION=str(report.get("version")),
            INSTANCES=len(server.instances),
            SERVER_IDENTITY=server.server_identity,
        )
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        try:
            for fd in fds:
                os.set_inheritable(fd, True)
            os.execv(argv[0], argv)
        except OSError as exc:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.set_inheritable(fd, False)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            raise ReloadRefused(f"exec of {argv[0]} failed: {exc}") from None


def _reaped_unseen(inst: Any) -> str | None:
    """An agent reaped by the child watcher whose exit the event loop has not applied yet."""
    proc = inst.process
    if proc is None or proc.returncode is not None:
        return None
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return f"instance {inst.instance_id}: its agent's exit is being applied"
    return None


class _Preflight:
    """One run of the installed code's preflight (``daemon.agentctl.reload.preflight``): ``start`` waits
    until it has imported everything; ``check`` gives it the captured state and reads its report."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_task: asyncio.Task[bytes]) -> None:
        self._proc = proc
        self._stderr = stderr_task
        self._started = time.monotonic()

    @classmethod
    async def start(cls, argv: list[str]) -> _Preflight:
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID")}
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
        except OSError as exc:
            raise ReloadRefused(f"cannot run the installed code's preflight: {exc}") from None
        assert proc.stdout is not None and proc.stderr is not None
        preflight = cls(proc, asyncio.get_running_loop().create_task(_tail(proc.stderr)))
        try:
            line = await within(proc.stdout.readline(), PREFLIGHT_TIMEOUT_S)
        except TimeoutError:
            await preflight.abandon()
            raise ReloadRefused(
                f"the installed code's preflight did not import within {PREFLIGHT_TIMEOUT_S:g} s") from None
        if not line.startswith(b"imported "):  # preflight.IMPORTED
            raise await preflight._failure()
        return preflight

    async def _failure(self) -> ReloadRefused:
        with contextlib.suppress(TimeoutError):
            await within(self._proc.wait(), 10.0)
        await self.abandon()
        err = self._stderr.result() if self._stderr.done() and not self._stderr.cancelled() else b""
        lines = [line for line in err.decode("utf-8", "replace").strip().splitlines() if line.strip()]
        why = lines[-1] if lines else "no message"
        return ReloadRefused(f"the installed code failed its preflight (exit {self._proc.returncode}): {why}")

    async def check(self, state: bytes) -> dict[str, Any]:
        """Hand it the state; its report, or ReloadRefused with why."""
        try:
            out = await within(self._exchange(state), PREFLIGHT_TIMEOUT_S)
        except TimeoutError:
            await self.abandon()
            raise ReloadRefused(
                f"the installed code's preflight did not finish within {PREFLIGHT_TIMEOUT_S:g} s") from None
        if self._proc.returncode != 0:
            raise await self._failure()
        await self.abandon()
        try:
            report = json.loads(out.decode("utf-8"))
        except ValueError:
            raise ReloadRefused("the installed code's preflight printed no report") from None
        if not isinstance(report, dict) or report.get("ok") is not True:
            raise ReloadRefused(f"the installed code's preflight did not pass: {str(report)[:300]}")
        if report.get("code_root") != code_root():
            raise ReloadRefused(f"the next exec would load code from {report.get('code_root')!r}, not from"
                                f" {code_root()!r}")
        log.info("preflight of version %s passed (%.0f ms from its start)", report.get("version"),
                 (time.monotonic() - self._started) * 1000)
        return report

    async def _exchange(self, state: bytes) -> bytes:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died: its exit says why
            proc.stdin.write(state)
            await proc.stdin.drain()
        proc.stdin.close()
        out = await proc.stdout.read()
        await proc.wait()
        return out

    async def abandon(self) -> None:
        """Make sure the process is gone and reaped (idempotent)."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        with contextlib.suppress(TimeoutError):
            await within(asyncio.shield(self._stderr), 2.0)
        if not self._stderr.done():
            self._stderr.cancel()


async def _tail(stream: asyncio.StreamReader, keep: int = 4096) -> bytes:
    """Read ``stream`` to its end, keeping its last ``keep`` bytes."""
    kept = b""
    while chunk := await stream.read(65536):
        kept = (kept + chunk)[-keep:]
    return kept
