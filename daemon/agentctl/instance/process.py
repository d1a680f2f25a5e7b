"""What runs for one agent and how it ends: spawn, environment, identity, signals, death.

``InstanceSpec`` is what ``create_instance`` asked to run (the command, its sandboxed argv, its
environment and secrets, the workspace). ``AgentProcess`` owns the agent's process group (its own session and group,
``start_new_session``): the spawn itself (never with the SDK's spawn helpers), its identity
(pid, process start time, from psutil; the group is signalled only while that identity still
holds: ``signal_group``), bwrap's init of a sandboxed agent (``group_alive``), and the kill
(``kill_group``: SIGTERM to the group, up to ``KILL_GRACE`` seconds, then SIGKILL; it never
blocks for ever). ``AdoptedProcess`` stands for a process the previous image spawned (after a
re-exec).

The agent's environment is built from a fixed allow-list (``agent_environment``: never the
server's ``PATH`` or ``HOME``) plus the request's ``env``; its ``oom_score_adj`` is
``AGENT_OOM_SCORE_ADJ`` (the kernel's first choice under memory pressure, never a daemon), and
``PR_SET_PDEATHSIG=SIGKILL`` means an agent never outlives its control server (``_child_setup``),
which also puts the child in the agent's memory cgroup before it executes anything
(``daemon.agentctl.instance.memory``).
A sandboxed agent (``spec.launch_argv``, built by ``daemon.agentctl.sandbox.bubblewrap``) is spawned the same
way: its sandbox's ``bwrap`` is the process that gets all of the above, and everything inside
stays in its process group. The state of the instance this process belongs to is
``daemon.agentctl.instance.instance``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from daemon.agentctl.instance.memory import AgentMemory
from daemon.agentctl.instance.pipe import AGENT_STDOUT_LIMIT
from daemon.agents.settings import AGENT_PATH
from daemon.host import process_start
from daemon.host.agent_user import AgentUserMissing, agent_user
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL of the group."""
REAP_TIMEOUT = 5.0
"""Seconds to wait for the kernel to report the leader's death after SIGKILL."""
INHERITED_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
"""The only variables of the server an agent gets (their values are no path of the host)."""
AGENT_HOME_DEFAULT = "/tmp"  # the sandbox's private /tmp, when the request names no HOME
AGENT_OOM_SCORE_ADJ = 500

_PR_SET_PDEATHSIG = 1


@dataclass
class InstanceSpec:
    """What ``create_instance`` asked for."""

    instance_id: str
    session_id: str
    task_id: str
    command: list[str]
    cwd: str
    env: dict[str, str] = field(default_factory=dict)
    agent: str | None = None
    resume_session_id: str | None = None
    workspace_roots: list[str] = field(default_factory=list)
    # The argv actually executed when it is not ``command``: the agent wrapped in its sandbox
    # (``daemon.agentctl.sandbox.bubblewrap.wrap_command``); the sandbox's bwrap is then the group leader.
    launch_argv: list[str] | None = None
    sandboxed: bool = False
    # The agent's secret values (``daemon.agentctl.sandbox.agent_env``), for its environment only: emptied
    # once the agent is spawned (it has them), so they never travel in a re-exec's hand-over.
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    # The agent's memory bound in bytes and the memory cgroup that enforces it (its directory; None:
    # unbounded here), carried across a re-exec so the next image keeps the agent in it.
    max_memory: int | None = None
    memory_cgroup: str | None = None
    # Descriptors bwrap inherits (the user namespace of ``daemon.agentctl.sandbox.userns.make_userns``):
    # closed here once the agent is spawned (or stopped before it was).
    launch_fds: list[int] = field(default_factory=list, repr=False)
    # The agent's network (``daemon.agentctl.egress.host.EgressHost.record``): its policy, its proxy
    # socket and its refusals so far; a re-exec carries it, and the next image opens the socket again.
    network: dict[str, Any] | None = None


SPEC_NOT_HANDED_OVER = frozenset({"secret_env", "launch_fds"})
"""``InstanceSpec`` fields a re-exec does not carry: the running agent already has its secrets."""


def _load_prctl() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()  # resolved in the parent: the child only calls it


def _child_setup(parent_pid: int, *, ignore_sigterm: bool = False,
                 cgroup_procs: int | None = None) -> Callable[[], None]:
    """``preexec_fn``: die with the control server (SIGKILL), even if it died before this ran;
    the agent's ``oom_score_adj`` (raising it needs no privilege; everything inside inherits it).
    ``ignore_sigterm``: for a sandbox's bwrap, which must not end before the agent it runs does
    (the agent gets the default action back: ``daemon.agentctl.sandbox.bubblewrap``).
    ``cgroup_procs``: the ``cgroup.procs`` of the agent's memory cgroup, which the child joins
    before it executes anything (a failure raises, and the spawn fails)."""

    def setup() -> None:
        if cgroup_procs is not None:
            os.write(cgroup_procs, str(os.getpid()).encode())
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            try:
                os.write(fd, str(AGENT_OOM_SCORE_ADJ).encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # no /proc: the agent keeps the server's score
        if os.getppid() != parent_pid:
            os._exit(125)

    return setup


def agent_environment(extra: Mapping[str, str] | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The agent's environment: a fixed allow-list (``PATH`` of the system directories, ``HOME``
    the sandbox's /tmp, ``USER``/``LOGNAME`` of the agent's uid, the locale and terminal type of
    the server), then the request's ``env`` (the agent's configuration, its session's HOME)."""
    source = os.environ if base is None else base
    env = {k: source[k] for k in INHERITED_ENV if k in source}
    env["PATH"] = AGENT_PATH
    env["HOME"] = AGENT_HOME_DEFAULT
    try:
        env["USER"] = env["LOGNAME"] = agent_user().name
    except AgentUserMissing:
        pass
    env.update(extra or {})
    return env


def with_safe_directory(env: dict[str, str], workspace: str) -> dict[str, str]:
    """``env`` with git's ``safe.directory`` for the workspace, and nothing wider, in the agent's own
    configuration (git's environment-borne configuration, after any the agent's env already has):
    git in the sandbox then works on a workspace another uid owns (a user's directory shared with
    ``kandev-agent`` through a group)."""
    try:
        n = int(env.get("GIT_CONFIG_COUNT", "0"))
    except ValueError:
        return env
    out = dict(env)
    out["GIT_CONFIG_COUNT"] = str(n + 1)
    out[f"GIT_CONFIG_KEY_{n}"] = "safe.directory"
    out[f"GIT_CONFIG_VALUE_{n}"] = workspace
    return out


def killed_by(code: int | None, sandboxed: bool) -> signal.Signals | None:
    """The signal an agent's exit status says it died of: a negative return code (the leader
    itself), or for a sandboxed agent bwrap's ``128 + signal`` (the agent inside)."""
    if code is None:
        return None
    number = -code if code < 0 else code - 128 if sandboxed and 128 < code < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number)
    except ValueError:
        return None


def close_launch_fds(spec: InstanceSpec) -> None:
    """Close the descriptors bwrap was to inherit (once spawned, or stopped before it was)."""
    for fd in spec.launch_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    spec.launch_fds = []


class AgentProcess:
    """The agent's process group and its identity (see the module docstring)."""

    def __init__(self, sandboxed: bool) -> None:
        self.sandboxed = sandboxed
        self.proc: asyncio.subprocess.Process | AdoptedProcess | None = None
        self.pid: int | None = None
        self.pid_start_time: float | None = None  # wall-clock seconds, as people read a start
        self.pid_start_stamp: str | None = None  # what a later check compares (``process_start.stamp``)
        self.psproc: psutil.Process | None = None  # the identity signals are checked against
        self.sandbox_init: psutil.Process | None = None  # bwrap's init of a sandboxed agent
        self.stopped_by_us = False  # a signal we sent (stop) is not a kill to report

    async def spawn(self, spec: InstanceSpec, agent_log_dir: Path, memory: AgentMemory | None = None) -> int:
        """Start the agent in its own session and group (and in its memory cgroup, ``memory``, then
        watched: see ``_child_setup``); returns the read end of its stderr pipe. The spec's secrets
        and launch descriptors are gone from this server once it returns."""
        cgroup_procs = memory.procs_fd() if memory is not None else None
        agent_log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stderr_read, stderr_write = os.pipe2(os.O_CLOEXEC)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *(spec.launch_argv or spec.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr_write,
                cwd=spec.cwd,
                env=with_safe_directory(agent_environment({**spec.env, **spec.secret_env}), spec.cwd),
                start_new_session=True,
                preexec_fn=_child_setup(os.getpid(), ignore_sigterm=spec.sandboxed, cgroup_procs=cgroup_procs),
                pass_fds=tuple(spec.launch_fds),
                limit=AGENT_STDOUT_LIMIT,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            os.close(stderr_read)
            raise IpcError(
                ErrorCode.AGENT_ERROR, f"cannot start agent {spec.command[0]!r}: {exc}", retryable=False
            ) from None
        finally:
            os.close(stderr_write)
            if cgroup_procs is not None:
                os.close(cgroup_procs)
            close_launch_fds(spec)
            spec.secret_env = {}  # the agent has them now; nothing of this server keeps them
        if memory is not None:
            memory.watch()
        self.pid = self.proc.pid
        try:
            self.psproc = psutil.Process(self.pid)
            self.pid_start_time = self.psproc.create_time()
            self.pid_start_stamp = _start_stamp(self.pid)
        except psutil.Error:
            # Already dead and reaped: without an identity, the group is never signalled.
            self.psproc = None
        return stderr_read

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def signal_group(self, sig: int) -> bool:
        """Signal the agent's process group if it is still ours; True if a signal was sent.

        The leader alive: signalled only if psutil's (pid, start time) identity
        still matches. The leader gone: Linux never hands out a pid still in use
        as a process-group id, so a group with that id is ours, unless another
        process now owns the pid (then our group is empty and nothing is sent).
        """
        if self.psproc is None or self.pid is None:
            return False
        try:
            if not self.psproc.is_running() and psutil.pid_exists(self.pid):
                return False  # the pid was reused: our group is gone
        except psutil.Error:
            return False
        try:
            os.killpg(self.pid, sig)
            if sig:
                self.stopped_by_us = True
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def find_sandbox_init(self) -> None:
        """A sandboxed agent: remember bwrap's init in the new pid namespace (the leader's child)."""
        if not self.sandboxed or self.sandbox_init is not None or self.psproc is None:
            return
        try:
            children = self.psproc.children()
        except psutil.Error:
            return
        if children:
            self.sandbox_init = children[0]

    def group_alive(self) -> bool:
        """Whether any process of the agent's group remains.

        A sandbox whose leader (bwrap) was reaped is gone once bwrap's init in the agent's pid
        namespace has exited: the namespace, the rest of the group, dies with it. That init then
        waits, a zombie of the group, for whoever inherited it to reap it, which some inits do late.
        """
        if not self.signal_group(0):
            return False
        init = self.sandbox_init
        if init is not None and self.proc is not None and self.proc.returncode is not None:
            try:
                return bool(init.is_running() and init.status() != psutil.STATUS_ZOMBIE)
            except psutil.Error:
                return False
        return True

    async def _wait_group_gone(self, timeout: float) -> bool:
        """Wait until the leader is reaped and no process of the group is left."""
        proc = self.proc
        assert proc is not None
        deadline = time.monotonic() + timeout
        try:
            await within(proc.wait(), timeout)
        except TimeoutError:
            return False
        while self.group_alive():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def kill_group(self) -> str | None:
        """SIGTERM to the group, up to ``KILL_GRACE`` s, then SIGKILL to whatever is left. Returns
        the signal the group ended on (``SIGTERM`` within the grace, ``SIGKILL`` after it), None if
        nothing of it was left to signal."""
        if self.proc is None:
            return None
        self.find_sandbox_init()
        if self.proc.returncode is None or self.group_alive():
            self.signal_group(signal.SIGTERM)
            if await self._wait_group_gone(KILL_GRACE):
                return signal.SIGTERM.name
        if self.signal_group(signal.SIGKILL):
            await self._wait_group_gone(REAP_TIMEOUT)
            return signal.SIGKILL.name
        return None

    # -- across a re-exec ----------------------------------------------------------

    def identity_handover(self) -> dict[str, Any]:
        """The agent's and bwrap's init's identities for the next process image: pid and start time,
        and the start in ticks since boot, which a step of the wall clock between now and the
        exec cannot move (``daemon.host.process_start``). The agent is our child, so its pid is its
        own until we reap it; bwrap's init is found now if it never was."""
        identity: dict[str, Any] = {"pid_start_ticks": _start_ticks(self.pid) if self.psproc is not None else None}
        self.find_sandbox_init()
        init = self.sandbox_init
        if init is None:
            return identity
        try:
            return {**identity, "sandbox_init_pid": init.pid, "sandbox_init_start_time": init.create_time(),
                    "sandbox_init_start_ticks": _start_ticks(init.pid)}
        except psutil.Error:
            return identity  # gone already: nothing of the sandbox is left to wait for

    def resume_identity(self, sandbox_init_pid: int | None, sandbox_init_start_time: float | None,
                        pid_start_ticks: int | None = None, sandbox_init_start_ticks: int | None = None) -> str | None:
        """The previous image's agent, by pid and start; what could not be taken over, if anything.
        bwrap's init of a sandboxed agent as the previous image knew it, if that process is still
        the same one; else found again from bwrap, as after a launch. The start is compared in ticks
        since boot when the previous image gave them (0.3.0 and later), else as a wall-clock time."""
        lost = None
        assert self.pid is not None
        try:
            psproc = psutil.Process(self.pid)
            if not _same_start(psproc, self.pid_start_time, pid_start_ticks):
                lost = "process identity (the start time differs)"
            else:
                self.psproc = psproc
                # the ticks just compared, where the previous image gave them: no second read
                self.pid_start_stamp = (_stamp_of(pid_start_ticks) if pid_start_ticks is not None
                                        else _start_stamp(self.pid))
        except psutil.Error:
            self.psproc = None  # gone already: the exit watcher reports it
        if not self.sandboxed:
            return lost
        if sandbox_init_pid is not None:
            try:
                init = psutil.Process(sandbox_init_pid)
                if _same_start(init, sandbox_init_start_time, sandbox_init_start_ticks):
                    self.sandbox_init = init
            except psutil.Error:
                pass  # exited (and reaped) meanwhile: the sandbox is gone
        self.find_sandbox_init()
        return lost


class AdoptedProcess:
    """An agent the previous process image spawned (our child still): what ``Instance`` needs of an
    ``asyncio.subprocess.Process``. Its exit is watched through a pidfd, reaped here."""

    def __init__(
        self, pid: int, stdout: asyncio.StreamReader, stdin: asyncio.StreamWriter, returncode: int | None
    ) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stdin = stdin
        self.returncode = returncode
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        if returncode is not None:
            self._exited.set_result(returncode)
            return
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # not ours to wait for any more (cannot happen for an unreaped child)
            self._reap()
            return
        loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            code = os.waitstatus_to_exitcode(status) if pid else 255
        except ChildProcessError:
            code = 255  # reaped elsewhere: the status is gone
        self.returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


def _start_ticks(pid: int | None) -> int | None:
    """Process ``pid``'s start in ticks since boot; None if it cannot be read."""
    if pid is None:
        return None
    try:
        seen = process_start.read(pid)
    except OSError:
        return None
    return seen.ticks if seen is not None else None


def _start_stamp(pid: int) -> str | None:
    """Process ``pid``'s ``process_start.stamp``; None if it cannot be read."""
    try:
        return process_start.stamp(pid)
    except OSError:
        return None


def _stamp_of(ticks: int) -> str | None:
    """The stamp of this boot's process started at ``ticks`` (None: the boot id cannot be read)."""
    try:
        return process_start.stamp_of(ticks)
    except OSError:
        return None


def _same_start(proc: psutil.Process, start_time: float | None, start_ticks: int | None) -> bool:
    """Whether ``proc`` started when the previous image recorded: by ticks since boot where it gave
    them, else by wall-clock start time (an image before 0.3.0); nothing recorded: yes."""
    if start_ticks is not None:
        return _start_ticks(proc.pid) == start_ticks
    return start_time is None or proc.create_time() == start_time
