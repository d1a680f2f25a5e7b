"""One instance: an agent process group, its ACP connection and its event log.

State machine (supervisord-style; every change goes through ``_set_state``)::

    starting --(initialize + session/new|load answered)--> running
    starting --(handshake failed: group killed)----------> stopping --> stopped
    starting|running --(agent process exited)-----------> exited
    starting|running|exited --(stop())-------------------> stopping --> stopped

``exited`` instances stay listed (with their exit code, retained events and
turn outcomes) until ``stop()``; ``stopped`` is final and the server forgets
the instance.

Process handling (docs/architecture.md#the-control-server-inside): the agent is
spawned here, never with the SDK's spawn helpers: its own session and process group
(``start_new_session``), stderr a pipe to this server (``agent_logs.StderrSink``
writes its file, bounded), an environment built from a fixed allow-list (``agent_environment``:
never the server's ``PATH`` or ``HOME``) plus the request's ``env``, ``oom_score_adj``
``AGENT_OOM_SCORE_ADJ`` (the kernel's first choice under memory pressure, never a daemon), and
``PR_SET_PDEATHSIG=SIGKILL`` so that an agent never outlives its control server. An agent killed
by a signal nobody here sent (the OOM killer, a stray ``kill``) is reported as such:
``agent_exited`` carries the ``signal`` and the journal says ``agent_killed``. Its identity is (pid, process
start time) from psutil; the group is signalled only while that identity
still holds (see ``_signal_group``). ``stop()`` sends SIGTERM to the group,
waits up to ``KILL_GRACE`` seconds, then SIGKILL; it never blocks for ever.
A sandboxed agent (``spec.launch_argv``, built by ``daemon.agentctl.sandbox``)
is spawned the same way: its sandbox's ``bwrap`` is the process that gets all
of the above, and everything inside stays in its process group.

ACP: the agent's pipes are wrapped in ``AgentPipeTransport`` (newline-
delimited JSON, the SDK's framing) and handed to ``acp.connect_to_agent``.
The SDK runs handlers as separate tasks, so events are numbered in a stream
observer, which the SDK calls synchronously in arrival order:
``session/update`` notifications and ``session/request_permission`` requests
become events there, with ``data`` taken from the raw JSON-RPC message.

Turns: ``prompt`` opens a turn with a server-wide unique id and appends
``turn_started``; when the agent answers the prompt, ``turn_ended`` is
appended (after every ``session_update`` the agent sent before its answer)
and the outcome is retained until ``ack_turn`` names it
(AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.6).

Runtime configuration (the RESETCFG rules): ``session_info`` keeps what the agent
reported about its current ACP session (modes, config options); ``set_mode``
and ``set_config_option`` send the ACP requests on that session and answer
``last_seq`` (every update the agent sent before answering is numbered by
then); ``reset_context`` opens a new ACP session (``session/new``) on the same
process and makes it the current one. ``handshake_seq`` is the last seq of the
handshake, e.g. the history a ``session/load`` replays.

Detached retention (AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6,
AC-EXECUTORS-SURVIVAL-001.9, AC-EXECUTORS-SURVIVAL-001.10; the rule is in
``daemon.agentctl.events``): ``AgentPipeTransport.receive()`` awaits
``EventLog.wait_for_room()`` before it hands each agent message over, so a full
detached log holds the message back and the agent blocks in its own write. The
bound is armed once the handshake is done; ``attach`` and acks release the
producer; ``stop()`` closes the log first, releasing every parked producer at
once; ``agent_exited`` is appended only once stdout is drained. Why this holds
(no deadlock, nothing dropped, nothing overtaken): docs/architecture.md#the-control-server-inside,
"How the pause is built".

- Permission requests have no auto-cancel timer in this project, attached or
  not: a request stays open until ``respond_permission``, a ``cancel``, the
  agent's exit, or ``stop()`` (AC-EXECUTORS-SURVIVAL-001.9; docs/architecture.md#the-control-server-inside). A request raised
  while detached therefore never expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import json
import logging
import os
import signal
import subprocess
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import acp
import psutil
from acp.connection import StreamDirection, StreamEvent
from acp.exceptions import RequestError
from acp.schema import (
    AllowedOutcome,
    ClientCapabilities,
    DeniedOutcome,
    Implementation,
    PromptResponse,
    RequestPermissionResponse,
)

from daemon.agent_user import AgentUserMissing, agent_user
from daemon.agentctl import acp_internals, agent_logs
from daemon.agentctl.events import EventLog, Subscription
from daemon.agentctl.handover import (
    InstanceHandover,
    PermissionHandover,
    RequestHandover,
    from_fields,
    to_plain,
)
from daemon.agentctl.protocol import EventKind
from daemon.journal import log_event
from daemon.version import VERSION
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.agentctl.instance")

HANDSHAKE_TIMEOUT = 60.0
"""Seconds each of ``initialize`` and ``session/new|load`` may take. A real npm agent's cold start
is CPU-bound (OpenCode's and Gemini CLI's answer to ``initialize`` took 25 to 40 s on a busy
two-core host, 4 to 5 s on an idle one): the bound catches an agent that will never answer, not
a slow machine."""
KILL_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL of the group."""
REAP_TIMEOUT = 5.0
"""Seconds to wait for the kernel to report the leader's death after SIGKILL."""
LOAD_SETTLE = 0.5
"""After a ``session/load`` answer: the handshake ends once the agent has sent nothing for this
long. Agents replay a loaded session's history as ``session/update`` notifications, some before
their answer (OpenCode, Codex, Claude Code) and some after it (Gemini CLI writes its replay
asynchronously, after and around its answer); the replay is one burst. Everything up to the quiet
moment belongs to the handshake (``handshake_seq``), which the backend never puts in a transcript,
and no prompt can be sent before it (the instance is still starting), so no replayed update is
attributed to the next turn."""
STDOUT_DRAIN_GRACE = 2.0
"""After the agent exits, how long to wait for the rest of its stdout (a child may hold it open)."""
STDERR_TAIL_BYTES = 4096
AGENT_STDOUT_LIMIT = 64 * 1024
"""``StreamReader`` limit of the agent's stdout: it stops reading the pipe at about twice this, so
a parked producer leaves the agent blocked instead of buffering its output in the server. Longer
lines still work (``AgentPipeTransport._read_line`` reads them in pieces)."""
DEFAULT_DETACHED_EVENT_LIMIT = 100
"""The ``agentctl.detached_event_limit`` default; the server passes the validated setting."""
INHERITED_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TERM", "TZ")
"""The only variables of the server an agent gets (their values are no path of the host)."""
AGENT_PATH = "/usr/local/bin:/usr/bin:/bin"
"""An agent's ``PATH`` unless its configuration says otherwise: the system's directories only."""
AGENT_HOME_DEFAULT = "/tmp"  # the sandbox's private /tmp, when the request names no HOME
AGENT_OOM_SCORE_ADJ = 500
CLIENT_NAME = "kandev-agentctl"
CLIENT_VERSION = VERSION

_PR_SET_PDEATHSIG = 1


class InstanceState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"
    STOPPING = "stopping"
    STOPPED = "stopped"


_TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    InstanceState.STARTING: frozenset({InstanceState.RUNNING, InstanceState.EXITED, InstanceState.STOPPING}),
    InstanceState.RUNNING: frozenset({InstanceState.EXITED, InstanceState.STOPPING}),
    InstanceState.EXITED: frozenset({InstanceState.STOPPING}),
    InstanceState.STOPPING: frozenset({InstanceState.STOPPED}),
    InstanceState.STOPPED: frozenset(),
}


def can_transition(old: InstanceState, new: InstanceState) -> bool:
    """Whether the state machine allows ``old -> new``."""
    return new in _TRANSITIONS[old]


class TurnIds:
    """Server-wide turn ids ``<server_identity>:<n>``: never repeated in a lifetime, nor across
    lifetimes, since the identity is random per launch (docs/architecture.md#the-control-server-inside)."""

    def __init__(self, server_identity: str, counter: int = 0) -> None:
        self._prefix = server_identity
        self._counter = counter  # a re-exec goes on from the previous image's counter

    @property
    def counter(self) -> int:
        return self._counter

    def __call__(self) -> str:
        self._counter += 1
        return f"{self._prefix}:{self._counter}"


# ---------------------------------------------------------------- spawning


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


def _child_setup(parent_pid: int, *, ignore_sigterm: bool = False) -> Callable[[], None]:
    """``preexec_fn``: die with the control server (SIGKILL), even if it died before this ran;
    the agent's ``oom_score_adj`` (raising it needs no privilege; everything inside inherits it).
    ``ignore_sigterm``: for a sandbox's bwrap, which must not end before the agent it runs does
    (the agent gets the default action back: ``daemon.agentctl.sandbox``)."""

    def setup() -> None:
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


class AgentPipeTransport:
    """An ``acp`` message transport over the agent's stdin/stdout (newline-delimited JSON).

    Same framing as the SDK's stdio transport; owning it gives the server
    two things: ``eof`` (every line the agent wrote has been handed to the
    connection) and the place where reading pauses for backpressure
    (AC-EXECUTORS-SURVIVAL-001.6, docs/architecture.md#processes): before each message read is
    handed over, ``gate()`` is awaited (``EventLog.wait_for_room``); the next
    ``receive()`` is not even called meanwhile, so nothing more is read. No
    lock is held while it waits.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_garbage: Callable[[str], None] | None = None,
        gate: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._on_garbage = on_garbage
        self._gate = gate
        # A line read but not handed over yet (held back by the gate, or the reading was stopped
        # for a re-exec) and the pieces of a long line already taken from the reader: both stay
        # here, never in a local variable, so cancelling receive() at any await loses nothing.
        self._held: bytes | None = None
        self._partial: list[bytes] = []
        self._send_lock = asyncio.Lock()
        self._sending = 0  # send() calls not yet returned
        self.requests_sent: dict[Any, str] = {}  # JSON-RPC id -> method, until its answer is read
        self.eof = asyncio.Event()

    @property
    def drained(self) -> bool:
        """Whether every message the agent wrote was handed over: ``eof``, or nothing is held back
        and the reader holds the end of the pipe and nothing else (also while parked)."""
        return self.eof.is_set() or (self._held is None and not self._partial and self._reader.at_eof())

    @property
    def writes_settled(self) -> bool:
        """No send in progress and nothing of ours waiting to go into the agent's stdin pipe."""
        transport = self._writer.transport
        return self._sending == 0 and (transport.is_closing() or transport.get_write_buffer_size() == 0)

    def unread(self, buffered: bytes) -> bytes:
        """Everything read from the agent and not handed over, in order, given the reader's buffer."""
        return (self._held or b"") + b"".join(self._partial) + buffered

    async def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        self._sending += 1
        try:
            async with self._send_lock:
                if self._writer.is_closing():
                    raise ConnectionResetError("the agent's stdin is closed")
                if "method" in message and "id" in message:
                    self.requests_sent[message["id"]] = str(message["method"])
                self._writer.write(data)
                await self._writer.drain()
        finally:
            self._sending -= 1

    async def receive(self) -> dict[str, Any] | None:
        try:
            while True:
                if self._held is None:
                    line = await self._read_line()
                    if not line:
                        self.eof.set()
                        return None
                    self._held = line
                line = self._held.strip()
                if not line:
                    self._held = None
                    continue
                try:
                    message = json.loads(line)
                except ValueError:
                    message = None
                if self._gate is not None:
                    # Parks, holding this one message back, while the detached bound is reached.
                    # Checked after the read (not before it) so that events the server appended
                    # while this read was waiting for the agent count too.
                    await self._gate()
                self._held = None
                if isinstance(message, dict):
                    if "method" not in message and "id" in message:
                        self.requests_sent.pop(message["id"], None)  # the answer to one of ours
                    return message
                if self._on_garbage is not None:
                    self._on_garbage(line[:200].decode("utf-8", errors="replace"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken pipe is the end of the conversation
            log.warning("reading the agent's stdout failed: %s", exc)
            self.eof.set()
            return None

    async def _read_line(self) -> bytes:
        try:
            while True:
                try:
                    last = await self._reader.readuntil(b"\n")
                    break
                except asyncio.LimitOverrunError as exc:
                    # exc.consumed bytes are buffered already: this read never waits.
                    self._partial.append(await self._reader.readexactly(exc.consumed))
        except asyncio.IncompleteReadError as exc:
            last = exc.partial
        line = b"".join(self._partial) + last
        self._partial.clear()
        return line

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


# ---------------------------------------------------------------- ACP client side


@dataclass
class _Permission:
    request_id: str
    option_ids: list[str]
    future: asyncio.Future[str | None]
    rpc_id: str
    turn_id: str | None = None
    tool_call_id: str = ""
    message: dict[str, Any] = field(default_factory=dict)  # the agent's raw request (for a hand-over)


class _AcpClient:
    """What the agent may call on us: session updates (numbered by the observer) and permissions."""

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        return None  # already recorded, in arrival order, by Instance._observe

    async def request_permission(
        self, session_id: str, tool_call: Any, options: list[Any], **kwargs: Any
    ) -> RequestPermissionResponse:
        option_id = await self._instance._permission_answer(str(tool_call.tool_call_id))
        if option_id is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=option_id))


# ---------------------------------------------------------------- the instance


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
    # (``daemon.agentctl.sandbox.wrap_command``); the sandbox's bwrap is then the group leader.
    launch_argv: list[str] | None = None
    sandboxed: bool = False
    # The agent's secret values (``daemon.agentctl.agent_env``), for its environment only: emptied
    # once the agent is spawned (it has them), so they never travel in a re-exec's hand-over.
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    # Descriptors bwrap inherits (the user namespace of ``daemon.agentctl.sandbox.make_userns``):
    # closed here once the agent is spawned (or stopped before it was).
    launch_fds: list[int] = field(default_factory=list, repr=False)


SPEC_NOT_HANDED_OVER = frozenset({"secret_env", "launch_fds"})
"""``InstanceSpec`` fields a re-exec does not carry: the running agent already has its secrets."""


class Instance:
    """One supervised agent. Create, then ``await start()``; always end with ``await stop()``."""

    def __init__(
        self,
        spec: InstanceSpec,
        *,
        agent_log_dir: str | os.PathLike[str],
        turn_ids: Callable[[], str],
        on_change: Callable[[Instance], None] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        detached_event_limit: int = DEFAULT_DETACHED_EVENT_LIMIT,
    ) -> None:
        if detached_event_limit < 1:
            raise ValueError(f"detached_event_limit must be >= 1, not {detached_event_limit}")
        self.spec = spec
        self.instance_id = spec.instance_id
        self.workspace_roots = list(spec.workspace_roots) or [spec.cwd]
        self.state = InstanceState.STARTING
        self.pid: int | None = None
        self.pid_start_time: float | None = None
        self.acp_session_id: str | None = None
        # What the agent reported for its current ACP session (session/new|load, reset_context):
        # {"modes": <SessionModeState JSON>|None, "config_options": [<config option JSON>]}.
        self.session_info: dict[str, Any] = {"modes": None, "config_options": []}
        self.handshake_seq = 0  # last seq appended during the handshake (e.g. a session/load replay)
        self._last_incoming = time.monotonic()  # when the agent last sent a message (LOAD_SETTLE)
        self.exit_code: int | None = None
        self.current_turn_id: str | None = None
        self.outcomes: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.log = EventLog()  # unbounded until the handshake is done (see the module docstring)
        self.detached_event_limit = detached_event_limit
        self._stop_signal = asyncio.Event()  # set first thing by stop(); every blocking wait watches it
        self.stderr_path = Path(agent_log_dir) / f"{spec.instance_id}.stderr.log"
        self._agent_log_dir = Path(agent_log_dir)
        self._turn_ids = turn_ids
        self._on_change = on_change
        self._handshake_timeout = handshake_timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._psproc: psutil.Process | None = None
        self._sandbox_init: psutil.Process | None = None  # bwrap's init of a sandboxed agent
        self.stderr_sink: agent_logs.StderrSink | None = None  # None: the agent writes its file itself (older image)
        self._stopped_by_us = False  # a signal we sent (stop) is not a kill to report
        self._stderr_handover_fd: int | None = None  # the stderr pipe while a re-exec is being prepared
        self._transport: AgentPipeTransport | None = None
        self._conn: acp.ClientSideConnection | None = None
        self._exit_task: asyncio.Task[None] | None = None
        self._prompt_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Future[None] | None = None
        self._exited = asyncio.Event()
        self._permissions: dict[str, _Permission] = {}
        self._permission_fifo: dict[str, deque[str]] = {}
        self._incoming_open: dict[str, str] = {}  # the agent's requests we have not answered: rpc key -> method
        self.not_taken_over: list[str] = []  # what a re-exec could not carry over (reported by describe)
        self._reading_paused_for_handover = False
        self._pipe_paused_for_handover = False

    # -- reporting -----------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The enumeration entry (AC-EXECUTORS-SURVIVAL-002.1): never the environment."""
        return {
            "instance_id": self.instance_id,
            "session_id": self.spec.session_id,
            "task_id": self.spec.task_id,
            "agent": self.spec.agent,
            "pid": self.pid,
            "pid_start_time": self.pid_start_time,
            "acp_session_id": self.acp_session_id,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "cwd": self.spec.cwd,
            "workspace_roots": list(self.workspace_roots),
            "current_turn_id": self.current_turn_id,
            "next_seq": self.log.next_seq,
            "retained_events": self.log.retained_count,
            "attached": self.log.attached,
            "paused": self.log.paused,
            "detached_event_limit": self.detached_event_limit,
            "sandboxed": self.spec.sandboxed,
            # What the agent reported about its current ACP session (RESETCFG-12).
            "modes": self.session_info.get("modes"),
            "config_options": list(self.session_info.get("config_options") or []),
            # What a re-exec of the control server could not carry over for this instance (empty
            # unless a reload reported something; Issue 15).
            "not_taken_over": list(self.not_taken_over),
        }

    @property
    def attached(self) -> bool:
        return self.log.attached

    @property
    def gone(self) -> bool:
        """Stopping or stopped: no longer usable."""
        return self.state in (InstanceState.STOPPING, InstanceState.STOPPED)

    def _set_state(self, new: InstanceState) -> None:
        if not can_transition(self.state, new):
            raise RuntimeError(f"instance {self.instance_id}: illegal transition {self.state.value} -> {new.value}")
        log.debug("instance %s: %s -> %s", self.instance_id, self.state.value, new.value)
        self.state = new
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:
                log.exception("instance %s: on_change failed", self.instance_id)

    # -- start ---------------------------------------------------------------

    def close_launch_fds(self) -> None:
        for fd in self.spec.launch_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.spec.launch_fds = []

    async def _spawn(self) -> None:
        spec = self.spec
        self._agent_log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stderr_read, stderr_write = os.pipe2(os.O_CLOEXEC)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *(spec.launch_argv or spec.command),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr_write,
                cwd=spec.cwd,
                env=with_safe_directory(agent_environment({**spec.env, **spec.secret_env}), spec.cwd),
                start_new_session=True,
                preexec_fn=_child_setup(os.getpid(), ignore_sigterm=spec.sandboxed),
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
            self.close_launch_fds()
            spec.secret_env = {}  # the agent has them now; nothing of this server keeps them
        self._start_stderr_sink(stderr_read)
        self.pid = self._proc.pid
        try:
            self._psproc = psutil.Process(self.pid)
            self.pid_start_time = self._psproc.create_time()
        except psutil.Error:
            # Already dead and reaped: without an identity, the group is never signalled.
            self._psproc = None

    def _start_stderr_sink(self, read_fd: int) -> None:
        self._stderr_handover_fd = None
        self.stderr_sink = agent_logs.StderrSink(read_fd, self.stderr_path, name=self.instance_id).start()

    async def start(self) -> None:
        """Spawn the agent and run the ACP handshake; on failure the group is killed and
        ``IpcError(agent_error)`` says why (exit code and stderr tail when the agent died)."""
        await self._spawn()
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        if self.gone:  # stopped while the process was being created
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await within(proc.wait(), REAP_TIMEOUT)
            raise IpcError(ErrorCode.SHUTTING_DOWN, f"instance {self.instance_id} was stopped while starting")
        self._transport = AgentPipeTransport(proc.stdout, proc.stdin, self._on_garbage, self.log.wait_for_room)
        self._exit_task = asyncio.create_task(self._watch_exit(), name=f"agentctl.exit.{self.instance_id}")
        self._conn = acp.connect_to_agent(_AcpClient(self), self._transport, observers=[self._observe])  # type: ignore[arg-type]  # partial acp.Client: acp answers method_not_found for the rest
        step = "initialize"
        try:
            init = await within(
                self._conn.initialize(
                    protocol_version=acp.PROTOCOL_VERSION,
                    client_capabilities=ClientCapabilities(),
                    client_info=Implementation(name=CLIENT_NAME, version=CLIENT_VERSION),
                ),
                self._handshake_timeout,
            )
            if init.protocol_version != acp.PROTOCOL_VERSION:
                raise _HandshakeRefused(
                    f"the agent speaks ACP protocol version {init.protocol_version}, not {acp.PROTOCOL_VERSION}"
                )
            if self.spec.resume_session_id:
                step = "session/load"
                loaded = await within(
                    self._conn.load_session(cwd=self.spec.cwd, session_id=self.spec.resume_session_id),
                    self._handshake_timeout,
                )
                # The answer names no session (ACP's LoadSessionResponse has no sessionId): the
                # loaded session is the one asked for.
                self.acp_session_id = self.spec.resume_session_id
                self.session_info = session_info(loaded)
                step = "session/load (its history replay)"
                await self._settle_replay()
            else:
                step = "session/new"
                session = await within(
                    self._conn.new_session(cwd=self.spec.cwd), self._handshake_timeout
                )
                self.acp_session_id = session.session_id
                self.session_info = session_info(session)
        except asyncio.CancelledError:
            await self.stop()
            raise
        except Exception as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, await self._handshake_failure(step, exc), retryable=False) from None
        if self.state is not InstanceState.STARTING:  # exited or stopped meanwhile
            raise IpcError(ErrorCode.AGENT_ERROR, await self._handshake_failure(step, None), retryable=False)
        self.handshake_seq = self.log.last_seq
        self.log.set_limit(self.detached_event_limit)  # the detached bound applies from now on
        self._find_sandbox_init()
        self._set_state(InstanceState.RUNNING)

    async def _settle_replay(self) -> None:
        """Wait until the agent has been quiet for ``LOAD_SETTLE`` seconds (at most the handshake
        timeout: an agent that never stops talking has not finished its load)."""
        deadline = time.monotonic() + self._handshake_timeout
        while True:
            if self.state is not InstanceState.STARTING or self._exited.is_set() or self._stop_signal.is_set():
                return  # exited or stopped meanwhile: start() reports it
            now = time.monotonic()
            quiet = now - self._last_incoming
            if quiet >= LOAD_SETTLE:
                return
            if now >= deadline:
                raise TimeoutError("the agent kept sending its history")
            await _wait_any((self._stop_signal, self._exited), min(LOAD_SETTLE - quiet, deadline - now) + 0.01)

    async def _handshake_failure(self, step: str, exc: BaseException | None) -> str:
        """Kill the group and describe why the handshake failed."""
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            reason = f"no answer to {step} within {self._handshake_timeout:g} s"
        elif isinstance(exc, RequestError):
            reason = f"the agent refused {step}: {_rpc_error_text(exc)}"
        elif exc is None or isinstance(exc, ConnectionError | OSError):
            reason = f"the agent went away during {step}"
        else:
            reason = f"{step} failed: {exc}"
        if not self.gone:
            # Let an agent that is exiting by itself report its own exit code.
            with contextlib.suppress(TimeoutError):
                await within(self._exited.wait(), 0.5)
        exited_by_itself = self._exited.is_set() and not self.gone
        await self.stop()
        parts = [f"agent {self.spec.agent or self.spec.command[0]!r}: {reason}"]
        if exited_by_itself:
            parts.append(f"exit code {self.exit_code}")
        tail = self.stderr_tail(1024).strip()
        if tail:
            parts.append(f"stderr tail: {tail}")
        return "; ".join(parts)

    # -- events from the agent --------------------------------------------------

    def _observe(self, event: StreamEvent) -> None:
        """Stream observer: called synchronously, in arrival order, for every JSON-RPC message."""
        message = event.message
        if event.direction is not StreamDirection.OUTGOING:
            self._last_incoming = time.monotonic()
        if event.direction is StreamDirection.OUTGOING:
            if "method" not in message and "id" in message:
                self._incoming_open.pop(_rpc_key(message["id"]), None)
                self._permission_answered(message["id"])
            return
        method = message.get("method")
        params = message.get("params")
        if not isinstance(params, dict):
            params = {}
        if method is not None and "id" in message:
            self._incoming_open[_rpc_key(message["id"])] = str(method)
        if method == "session/update" and "id" not in message:
            self.log.append(
                EventKind.SESSION_UPDATE, {"turn_id": self.current_turn_id, "update": params.get("update")}
            )
        elif method == "session/request_permission" and "id" in message:
            self._permission_requested(message["id"], params, message)

    def _on_garbage(self, line: str) -> None:
        self.log.append(EventKind.AGENT_ERROR, {"message": f"the agent wrote a line that is not JSON-RPC: {line}"})

    def _permission_requested(self, rpc_id: Any, params: dict[str, Any], message: dict[str, Any]) -> None:
        raw_tool_call, raw_options = params.get("toolCall"), params.get("options")
        tool_call: dict[str, Any] = raw_tool_call if isinstance(raw_tool_call, dict) else {}
        options: list[Any] = raw_options if isinstance(raw_options, list) else []
        option_ids = [str(o.get("optionId")) for o in options if isinstance(o, dict)]
        request_id = os.urandom(16).hex()
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        tool_call_id = str(tool_call.get("toolCallId"))
        self._permissions[request_id] = _Permission(
            request_id, option_ids, future, _rpc_key(rpc_id), self.current_turn_id, tool_call_id, message
        )
        self._permission_fifo.setdefault(tool_call_id, deque()).append(request_id)
        self.log.append(
            EventKind.PERMISSION_REQUEST,
            {"request_id": request_id, "turn_id": self.current_turn_id, "tool_call": tool_call, "options": options},
        )

    async def _permission_answer(self, tool_call_id: str) -> str | None:
        """Called by the SDK's request handler: wait for ``respond_permission`` (or stop/cancel)."""
        queue = self._permission_fifo.get(tool_call_id)
        request_id = queue.popleft() if queue else None
        if queue is not None and not queue:
            del self._permission_fifo[tool_call_id]
        pending = self._permissions.get(request_id) if request_id else None
        if pending is None:
            return None
        return await pending.future

    def _permission_answered(self, rpc_id: Any) -> None:
        """Our JSON-RPC response went out: forget the request (also when the SDK refused it)."""
        if not self._permissions:
            return
        key = _rpc_key(rpc_id)
        for request_id, pending in list(self._permissions.items()):
            if pending.rpc_id == key:
                del self._permissions[request_id]
                if not pending.future.done():
                    pending.future.set_result(None)
                for tool_call_id, queue in list(self._permission_fifo.items()):
                    if request_id in queue:
                        queue.remove(request_id)
                        if not queue:
                            del self._permission_fifo[tool_call_id]

    def _cancel_permissions(self, reason: str) -> None:
        """Answer every open request ``cancelled``; each one gets a ``permission_cancelled`` event
        (a no-op append once the log is closed, i.e. on stop)."""
        for pending in self._permissions.values():
            if not pending.future.done():
                pending.future.set_result(None)
                self.log.append(
                    EventKind.PERMISSION_CANCELLED,
                    {"request_id": pending.request_id, "turn_id": pending.turn_id, "reason": reason},
                )

    def respond_permission(self, request_id: str, option_id: str | None) -> None:
        pending = self._permissions.get(request_id)
        if pending is None or pending.future.done():
            raise IpcError(ErrorCode.NOT_FOUND, f"no open permission request {request_id!r} on this instance")
        if option_id is not None and option_id not in pending.option_ids:
            raise IpcError(
                ErrorCode.INVALID_ARGUMENT,
                f"option {option_id!r} is not one of {pending.option_ids} offered by request {request_id}",
            )
        pending.future.set_result(option_id)

    # -- turns ----------------------------------------------------------------

    def _require_running(self, what: str) -> acp.ClientSideConnection:
        if self.state is not InstanceState.RUNNING or self._conn is None:
            raise IpcError(ErrorCode.CONFLICT, f"cannot {what}: instance {self.instance_id} is {self.state.value}")
        return self._conn

    def prompt(self, text: str) -> str:
        """Open a turn and send the prompt; returns the turn id at once."""
        self._require_running("prompt")
        if self.current_turn_id is not None:
            raise IpcError(ErrorCode.CONFLICT, f"turn {self.current_turn_id} is still open on this instance")
        turn_id = self._turn_ids()
        self.current_turn_id = turn_id
        self.log.append(EventKind.TURN_STARTED, {"turn_id": turn_id, "text": text})
        self._prompt_task = asyncio.create_task(self._run_turn(turn_id, text), name=f"agentctl.turn.{turn_id}")
        return turn_id

    async def _run_turn(self, turn_id: str, text: str) -> None:
        conn = self._conn
        assert conn is not None and self.acp_session_id is not None
        await self._finish_turn(turn_id, conn.prompt(session_id=self.acp_session_id, prompt=[acp.text_block(text)]))

    async def _finish_turn(self, turn_id: str, answer: Awaitable[Any]) -> None:
        """Await the agent's answer to the turn's session/prompt and end the turn with it."""
        try:
            response = await answer
        except asyncio.CancelledError:
            raise
        except RequestError as exc:
            self._end_turn(turn_id, "error", _rpc_error_text(exc))
        except (ConnectionError, OSError) as exc:
            # The agent went away: the exit watcher ends the turn with agent_exited.
            with contextlib.suppress(TimeoutError):
                await within(self._exited.wait(), STDOUT_DRAIN_GRACE + 1.0)
            self._end_turn(turn_id, "error", f"lost the connection to the agent: {exc}")
        except Exception as exc:
            log.exception("instance %s: prompt failed", self.instance_id)
            self._end_turn(turn_id, "error", f"prompt failed: {exc}")
        else:
            self._end_turn(turn_id, str(response.stop_reason), None)

    def _end_turn(self, turn_id: str, stop_reason: str, error: str | None) -> None:
        """Close the open turn (no-op if ``turn_id`` is not the open one) and retain its outcome."""
        if self.current_turn_id != turn_id:
            return
        outcome = {"turn_id": turn_id, "stop_reason": stop_reason, "error": error}
        self.current_turn_id = None
        if self.gone:
            return
        self.outcomes[turn_id] = outcome
        self.log.append(EventKind.TURN_ENDED, dict(outcome))

    async def cancel(self) -> None:
        """ACP ``session/cancel``; open permission requests are answered ``cancelled`` (ACP rule)."""
        conn = self._require_running("cancel")
        assert self.acp_session_id is not None
        self._cancel_permissions("cancel")
        try:
            await conn.cancel(session_id=self.acp_session_id)
        except (ConnectionError, OSError) as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, f"cannot reach the agent: {exc}") from None

    # -- runtime configuration and context reset (docs/requirements.md#runtime-configuration-across-a-context-reset) -------------------------

    async def _config_call(self, what: str, call: Callable[[acp.ClientSideConnection], Awaitable[Any]]) -> Any:
        """One ACP request on the current session; a refusal is ``agent_error`` (not retryable)."""
        conn = self._require_running(what)
        try:
            return await within(call(conn), self._handshake_timeout)
        except RequestError as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, f"the agent refused {what}: {_rpc_error_text(exc)}", False) from None
        except TimeoutError:
            raise IpcError(ErrorCode.TIMEOUT, f"no answer to {what} within {self._handshake_timeout:g} s") from None
        except (ConnectionError, OSError) as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, f"cannot reach the agent for {what}: {exc}", False) from None

    async def set_mode(self, mode_id: str) -> dict[str, Any]:
        """ACP ``session/set_mode`` on the current session. ``last_seq`` covers every update the
        agent sent before it answered (the observer numbers messages in arrival order)."""
        session_id = self.acp_session_id
        await self._config_call(
            f"session/set_mode {mode_id!r}", lambda c: c.set_session_mode(session_id=session_id, mode_id=mode_id)
        )
        modes = self.session_info.get("modes")
        if isinstance(modes, dict):
            self.session_info["modes"] = {**modes, "currentModeId": mode_id}
        return {"acp_session_id": session_id, "mode_id": mode_id, "last_seq": self.log.last_seq}

    async def set_config_option(self, config_id: str, value: str | bool) -> dict[str, Any]:
        """ACP ``session/set_config_option``; answers the agent's authoritative option list."""
        session_id = self.acp_session_id
        response = await self._config_call(
            f"session/set_config_option {config_id}={value!r}",
            lambda c: c.set_config_option(config_id=config_id, session_id=session_id, value=value),
        )
        options = _dump_list(getattr(response, "config_options", None))
        if options:
            self.session_info["config_options"] = options
        return {"acp_session_id": session_id, "config_options": options, "last_seq": self.log.last_seq}

    async def reset_context(self) -> dict[str, Any]:
        """A new ACP session (``session/new``) on the same agent process: the fast path of a context
        reset. On success prompts go to the new session; on failure the current one stays."""
        if self.current_turn_id is not None:
            raise IpcError(ErrorCode.CONFLICT, f"turn {self.current_turn_id} is still open on this instance")
        cwd = self.spec.cwd
        session = await self._config_call("session/new (context reset)", lambda c: c.new_session(cwd=cwd))
        self.acp_session_id = session.session_id
        self.session_info = session_info(session)
        return {"acp_session_id": self.acp_session_id, **self.session_info, "last_seq": self.log.last_seq}

    def turn_status(self) -> dict[str, Any]:
        """Pure read (AC-EXECUTORS-SURVIVAL-004.6): the open turn and every retained outcome."""
        return {"current_turn_id": self.current_turn_id, "outcomes": [dict(o) for o in self.outcomes.values()]}

    def ack_turn(self, turn_id: str) -> bool:
        """Discard the retained outcome of ``turn_id``; False (and no change) if it is not held."""
        return self.outcomes.pop(turn_id, None) is not None

    # -- events to the backend -------------------------------------------------

    def _check_seq(self, seq: int, what: str) -> None:
        if seq < 0 or seq > self.log.last_seq:
            raise IpcError(
                ErrorCode.INVALID_ARGUMENT,
                f"{what} {seq} is outside 0..{self.log.last_seq} (the last seq of instance {self.instance_id})",
            )

    def attach(self, after_seq: int) -> Subscription:
        """Become the instance's one stream: events <= ``after_seq`` are discarded; a previous
        stream is closed."""
        self._check_seq(after_seq, "after_seq")
        return self.log.subscribe(after_seq)

    def detach(self, sub: Subscription) -> None:
        self.log.unsubscribe(sub)

    def ack_events(self, seq: int) -> int:
        self._check_seq(seq, "seq")
        return self.log.discard_through(seq)

    # -- exit and stop ---------------------------------------------------------

    async def _stderr_settled(self, timeout: float = STDOUT_DRAIN_GRACE) -> None:
        """Give the stderr sink up to ``timeout`` s to write what the agent left in the pipe."""
        sink = self.stderr_sink
        if sink is not None and not sink.eof:
            await asyncio.to_thread(sink.drained, timeout)

    def stderr_tail(self, limit: int = STDERR_TAIL_BYTES) -> str:
        try:
            with open(self.stderr_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                size = fh.tell()
                fh.seek(max(0, size - limit))
                return fh.read(limit).decode("utf-8", errors="replace")
        except OSError:
            return ""

    async def _watch_exit(self) -> None:
        proc = self._proc
        transport = self._transport
        assert proc is not None and transport is not None
        code = await proc.wait()
        # Everything the agent wrote before dying is numbered before agent_exited.
        await self._drain_stdout(transport)
        if self.state in (InstanceState.STARTING, InstanceState.RUNNING):
            await self._stderr_settled()
        self.exit_code = code
        self._exited.set()
        if self.state in (InstanceState.STARTING, InstanceState.RUNNING):
            sig = None if self._stopped_by_us else killed_by(code, self.spec.sandboxed)
            data: dict[str, Any] = {"exit_code": code, "stderr_tail": self.stderr_tail()}
            if sig is not None:
                data["signal"] = sig.name
            self.log.append(EventKind.AGENT_EXITED, data)
            how = f"was killed by {sig.name}" if sig is not None else f"exited with code {code}"
            if self.current_turn_id is not None:
                self._end_turn(self.current_turn_id, "agent_exited", f"the agent {how}")
            self._cancel_permissions("agent_exited")
            self._set_state(InstanceState.EXITED)
            fields: dict[str, Any] = {"INSTANCE_ID": self.instance_id, "SESSION_ID": self.spec.session_id,
                                      "TASK_ID": self.spec.task_id, "PID": self.pid, "EXIT_CODE": code}
            if sig is not None:
                log_event("agent_killed", f"agent of instance {self.instance_id} was killed by {sig.name}, a signal"
                          " kandev did not send (the kernel's OOM killer, or someone's kill)", priority=4,
                          SIGNAL=sig.name, **fields)
            else:
                log_event("agent_exited", f"agent of instance {self.instance_id} exited with code {code}",
                          priority=5, **fields)

    async def _drain_stdout(self, transport: AgentPipeTransport) -> None:
        """Wait until every line of the exited agent's stdout was read, the stop signal, or
        ``STDOUT_DRAIN_GRACE`` s of reading time (a child may hold stdout open). Time the producer
        spends parked by the detached bound does not count: the rest is read after an attach."""
        loop = asyncio.get_running_loop()
        grace = STDOUT_DRAIN_GRACE
        while not transport.drained and not self._stop_signal.is_set():
            if grace <= 0:
                log.warning("instance %s: the agent's stdout is still open %g s after its exit",
                            self.instance_id, STDOUT_DRAIN_GRACE)
                return
            paused = self.log.paused
            started = loop.time()
            await _wait_any((transport.eof, self._stop_signal), min(grace, 0.1) if not paused else 0.1)
            if not (paused and self.log.paused):
                grace -= loop.time() - started

    def _signal_group(self, sig: int) -> bool:
        """Signal the agent's process group if it is still ours; True if a signal was sent.

        The leader alive: signalled only if psutil's (pid, start time) identity
        still matches. The leader gone: Linux never hands out a pid still in use
        as a process-group id, so a group with that id is ours, unless another
        process now owns the pid (then our group is empty and nothing is sent).
        """
        if self._psproc is None or self.pid is None:
            return False
        try:
            if not self._psproc.is_running() and psutil.pid_exists(self.pid):
                return False  # the pid was reused: our group is gone
        except psutil.Error:
            return False
        try:
            os.killpg(self.pid, sig)
            if sig:
                self._stopped_by_us = True
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _find_sandbox_init(self) -> None:
        """A sandboxed agent: remember bwrap's init in the new pid namespace (the leader's child)."""
        if not self.spec.sandboxed or self._sandbox_init is not None or self._psproc is None:
            return
        try:
            children = self._psproc.children()
        except psutil.Error:
            return
        if children:
            self._sandbox_init = children[0]

    def group_alive(self) -> bool:
        """Whether any process of the agent's group remains.

        A sandbox whose leader (bwrap) was reaped is gone once bwrap's init in the agent's pid
        namespace has exited: the namespace, the rest of the group, dies with it. That init then
        waits, a zombie of the group, for whoever inherited it to reap it, which some inits do late.
        """
        if not self._signal_group(0):
            return False
        init = self._sandbox_init
        if init is not None and self._proc is not None and self._proc.returncode is not None:
            try:
                return bool(init.is_running() and init.status() != psutil.STATUS_ZOMBIE)
            except psutil.Error:
                return False
        return True

    async def stop(self) -> bool:
        """Kill the group and forget everything; True if this call did it, False if it was
        already stopping or stopped. Never blocks for ever (AC-EXECUTORS-SURVIVAL-001.10)."""
        if self._stop_task is not None:
            await asyncio.shield(self._stop_task)
            return False
        self._stop_task = asyncio.ensure_future(self._do_stop())
        await asyncio.shield(self._stop_task)
        return True

    async def _do_stop(self) -> None:
        # The stop signal first: it releases every parked producer at once (the log's close) and
        # every other wait of this instance, without waiting for a backend (AC-EXECUTORS-SURVIVAL-001.10).
        self._stop_signal.set()
        self.log.close()  # ends the attached stream, drops undelivered events, unparks producers
        previous = self.state
        self._set_state(InstanceState.STOPPING)
        self._cancel_permissions("stop")
        if self._prompt_task is not None and not self._prompt_task.done():
            self._prompt_task.cancel()
        ended_by = await self._kill_group()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await within(self._conn.close(), 2.0)
        if self._exit_task is not None and not self._exit_task.done():
            with contextlib.suppress(Exception):
                await within(asyncio.shield(self._exit_task), STDOUT_DRAIN_GRACE + 1.0)
            self._exit_task.cancel()
        if self._proc is not None and self._proc.returncode is not None:
            self.exit_code = self._proc.returncode
        self.close_launch_fds()
        if self.stderr_sink is not None:
            await self._stderr_settled(1.0)  # the group is gone: the pipe ends once drained
            await asyncio.to_thread(self.stderr_sink.close)
        self._set_state(InstanceState.STOPPED)
        log_event(
            "instance_stopped",
            f"instance {self.instance_id} stopped (was {previous.value}; "
            + (f"its group ended on {ended_by})" if ended_by else "its group was gone already)"),
            INSTANCE_ID=self.instance_id,
            SESSION_ID=self.spec.session_id,
            TASK_ID=self.spec.task_id,
            PID=self.pid,
            STOP_SIGNAL=ended_by,
            EXIT_CODE=self.exit_code,
        )

    async def _wait_group_gone(self, timeout: float) -> bool:
        """Wait until the leader is reaped and no process of the group is left."""
        proc = self._proc
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

    async def _kill_group(self) -> str | None:
        """SIGTERM to the group, up to ``KILL_GRACE`` s, then SIGKILL to whatever is left. Returns
        the signal the group ended on (``SIGTERM`` within the grace, ``SIGKILL`` after it), None if
        nothing of it was left to signal."""
        if self._proc is None:
            return None
        self._find_sandbox_init()
        if self._proc.returncode is None or self.group_alive():
            self._signal_group(signal.SIGTERM)
            if await self._wait_group_gone(KILL_GRACE):
                return signal.SIGTERM.name
        if self._signal_group(signal.SIGKILL):
            await self._wait_group_gone(REAP_TIMEOUT)
            return signal.SIGKILL.name
        return None


    # -- re-exec hand-over (daemon.agentctl.reexec captures, daemon.agentctl.resume restores) ------

    def pause_for_handover(self) -> asyncio.Task[Any] | None:
        """Stop reading the agent at a message boundary: the connection's receive loop is cancelled
        (a line being read or held back by the detached bound stays in the transport). Returns the
        stopped loop's task (await it) or None if nothing was reading."""
        if self.state is InstanceState.RUNNING and self.stderr_sink is not None and self._stderr_handover_fd is None:
            self._stderr_handover_fd = self.stderr_sink.pause()  # what the agent writes now waits in the pipe
        if self._conn is None or not acp_internals.receiving(self._conn):
            return None
        self._reading_paused_for_handover = True
        if self._proc is not None:  # and the pipe: what the agent writes now waits in the pipe
            self._pipe_paused_for_handover = acp_internals.pause_pipe(self._proc.stdout)
        return acp_internals.stop_receiving(self._conn)

    def resume_after_refusal(self) -> None:
        """A refused reload: read the agent again, from where ``pause_for_handover`` stopped."""
        if self._stderr_handover_fd is not None:
            self._start_stderr_sink(self._stderr_handover_fd)
        if self._reading_paused_for_handover and self._conn is not None and not self.gone:
            self._reading_paused_for_handover = False
            if self._pipe_paused_for_handover and self._proc is not None:
                acp_internals.resume_pipe(self._proc.stdout)
            self._pipe_paused_for_handover = False
            if not acp_internals.receiving(self._conn):
                acp_internals.restart_receiving(self._conn)

    def handover_blocker(self) -> str | None:
        """None once this instance can be captured as it is; otherwise what is still moving.

        Reading is paused first; then every write to the agent must be on its way (nothing of ours
        in a send or in the pipe transport's buffer), the open turn's session/prompt must be out
        and unanswered (or the turn ended), and the only requests of the agent we have not
        answered must be permission requests nobody answered yet: those travel, answers being
        written do not.
        """
        if self.state in (InstanceState.STARTING, InstanceState.STOPPING):
            return f"instance {self.instance_id} is {self.state.value}"
        conn, transport = self._conn, self._transport
        if self.state is not InstanceState.RUNNING or conn is None or transport is None:
            return None
        if acp_internals.receiving(conn):
            return f"instance {self.instance_id}: still reading the agent"
        if not transport.writes_settled:
            return f"instance {self.instance_id}: a write to the agent's stdin is not done (does it read its stdin?)"
        pending = acp_internals.pending_request_ids(conn)
        if any(rid not in transport.requests_sent for rid in pending):
            return f"instance {self.instance_id}: a request to the agent is being sent"
        turn_task = self._prompt_task
        turn_in_flight = "session/prompt" in (transport.requests_sent.get(rid) for rid in pending)
        if self.current_turn_id is not None and turn_task is not None and not turn_task.done() and not turn_in_flight:
            return f"instance {self.instance_id}: turn {self.current_turn_id} is being sent or ended"
        waiting = {p.rpc_id for p in self._permissions.values() if not p.future.done()}
        for key, method in self._incoming_open.items():
            if key not in waiting:
                return f"instance {self.instance_id}: the agent's {method} request is being answered"
        return None

    @property
    def process(self) -> Any:
        """The agent's process handle (``asyncio.subprocess.Process`` or ``AdoptedProcess``), or None."""
        return self._proc

    def handover_fds(self) -> list[int]:
        """The fds ``handover_state`` names: the agent's stdout and stdin pipes, while it runs."""
        proc = self._proc
        if self.state is not InstanceState.RUNNING or self._conn is None or proc is None:
            return []
        fds = (acp_internals.reader_fd(proc.stdout), acp_internals.writer_fd(proc.stdin), self._stderr_handover_fd)
        return [fd for fd in fds if fd is not None]

    def handover_state(self) -> InstanceHandover:
        """The instance as the next process image needs it (call once ``handover_blocker`` is None;
        synchronous, so nothing changes while it runs)."""
        proc, conn, transport = self._proc, self._conn, self._transport
        live = self.state is InstanceState.RUNNING and conn is not None and transport is not None
        requests: list[RequestHandover] = []
        permissions: list[PermissionHandover] = []
        stdout_fd = stdin_fd = None
        unread = b""
        if live:
            assert conn is not None and transport is not None and proc is not None
            for rid in acp_internals.pending_request_ids(conn):
                method = transport.requests_sent.get(rid, "")
                turn = self.current_turn_id if method == "session/prompt" else None
                requests.append(RequestHandover(rid, method, turn))
            permissions = [
                PermissionHandover(p.request_id, list(p.option_ids), p.turn_id, p.tool_call_id, p.message)
                for p in self._permissions.values() if not p.future.done()
            ]
            stdout_fd = acp_internals.reader_fd(proc.stdout)
            stdin_fd = acp_internals.writer_fd(proc.stdin)
            unread = transport.unread(acp_internals.buffered_bytes(proc.stdout))
        return InstanceHandover(
            spec={k: v for k, v in to_plain(self.spec).items() if k not in SPEC_NOT_HANDED_OVER},
            state=self.state.value,
            pid=self.pid,
            pid_start_time=self.pid_start_time,
            exit_code=self.exit_code,
            reaped_returncode=proc.returncode if proc is not None else None,
            acp_session_id=self.acp_session_id,
            session_info=to_plain(self.session_info),
            handshake_seq=self.handshake_seq,
            detached_event_limit=self.detached_event_limit,
            limit_armed=self.log.limit is not None,
            current_turn_id=self.current_turn_id,
            outcomes=[dict(o) for o in self.outcomes.values()],
            next_seq=self.log.next_seq,
            events=[[e.seq, e.kind, e.data] for e in self.log.retained()],
            stdout_fd=stdout_fd,
            stdin_fd=stdin_fd,
            unread=unread,
            next_request_id=acp_internals.next_request_id(conn) if conn is not None else 0,
            requests=requests,
            permissions=permissions,
            stderr_path=str(self.stderr_path),
            stderr_fd=self._stderr_handover_fd if live else None,
            not_taken_over=list(self.not_taken_over),
            **self._sandbox_init_handover(),
        )

    def _sandbox_init_handover(self) -> dict[str, Any]:
        """bwrap's init of a sandboxed agent by pid and start time (found now if it never was)."""
        self._find_sandbox_init()
        init = self._sandbox_init
        if init is None:
            return {}
        try:
            return {"sandbox_init_pid": init.pid, "sandbox_init_start_time": init.create_time()}
        except psutil.Error:
            return {}  # gone already: nothing of the sandbox is left to wait for

    @classmethod
    def from_handover(
        cls,
        h: InstanceHandover,
        *,
        agent_log_dir: str | os.PathLike[str],
        turn_ids: Callable[[], str],
        on_change: Callable[[Instance], None] | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ) -> Instance:
        """The instance of a previous process image, without its pipes yet (``resume_pipes``)."""
        lost: list[str] = []
        spec = from_fields(InstanceSpec, h.spec, "spec", lost)
        inst = cls(spec, agent_log_dir=agent_log_dir, turn_ids=turn_ids, handshake_timeout=handshake_timeout,
                   detached_event_limit=h.detached_event_limit)
        inst.state = InstanceState(h.state)
        inst.pid, inst.pid_start_time, inst.exit_code = h.pid, h.pid_start_time, h.exit_code
        inst.acp_session_id = h.acp_session_id
        inst.session_info = dict(h.session_info)
        inst.handshake_seq = h.handshake_seq
        inst.current_turn_id = h.current_turn_id
        inst.outcomes = OrderedDict((str(o.get("turn_id")), dict(o)) for o in h.outcomes)
        inst.log.restore(h.next_seq, [(int(e[0]), str(e[1]), e[2]) for e in h.events])
        if h.limit_armed:
            inst.log.set_limit(h.detached_event_limit)
        inst.stderr_path = Path(h.stderr_path)
        inst.not_taken_over = list(h.not_taken_over) + lost
        if inst.state is InstanceState.EXITED:
            inst._exited.set()
        inst._on_change = on_change
        return inst

    async def resume_pipes(self, h: InstanceHandover) -> None:
        """Take the agent's pipes back and go on exactly where the previous image stopped: unread
        bytes first, our requests still awaiting answers, the agent's open permission requests
        (their handlers answer them when a backend does), the open turn."""
        if self.state is not InstanceState.RUNNING or self.pid is None:
            return
        try:
            psproc = psutil.Process(self.pid)
            if self.pid_start_time is not None and psproc.create_time() != self.pid_start_time:
                self.not_taken_over.append("process identity (the start time differs)")
            else:
                self._psproc = psproc
        except psutil.Error:
            self._psproc = None  # gone already: the exit watcher reports it
        self._resume_sandbox_init(h)
        if h.stderr_fd is not None:
            self._start_stderr_sink(h.stderr_fd)
        reader, writer = await acp_internals.adopt_pipes(h.stdout_fd, h.stdin_fd, h.unread, AGENT_STDOUT_LIMIT)
        self._proc = AdoptedProcess(self.pid, reader, writer, h.reaped_returncode)  # type: ignore[assignment]
        self._transport = AgentPipeTransport(reader, writer, self._on_garbage, self.log.wait_for_room)
        self._exit_task = asyncio.create_task(self._watch_exit(), name=f"agentctl.exit.{self.instance_id}")
        conn = self._conn = acp.connect_to_agent(_AcpClient(self), self._transport, observers=[self._observe])  # type: ignore[arg-type]  # partial acp.Client
        # Synchronous from here on: the connection's receive loop has not run yet.
        answers = acp_internals.restore_requests(conn, h.next_request_id, [r.rpc_id for r in h.requests])
        turn_resumed = False
        for request in h.requests:
            self._transport.requests_sent[request.rpc_id] = request.method
            answer = answers[request.rpc_id]
            if request.method == "session/prompt" and request.turn_id and request.turn_id == self.current_turn_id:
                self._prompt_task = asyncio.create_task(
                    self._finish_turn(request.turn_id, _prompt_response(answer)), name=f"agentctl.turn.{request.turn_id}"
                )
                turn_resumed = True
            else:
                self.not_taken_over.append(f"the answer to {request.method or 'a request'} sent before the re-exec")
                asyncio.create_task(_discard_answer(self.instance_id, request.method, answer))
        for p in h.permissions:
            future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
            rpc = _rpc_key(p.message.get("id"))
            self._permissions[p.request_id] = _Permission(
                p.request_id, list(p.option_ids), future, rpc, p.turn_id, p.tool_call_id, p.message
            )
            self._permission_fifo.setdefault(p.tool_call_id, deque()).append(p.request_id)
            self._incoming_open[rpc] = "session/request_permission"
        for p in h.permissions:
            acp_internals.replay_request(conn, p.message)
        if self.current_turn_id is not None and not turn_resumed:
            self.not_taken_over.append(f"turn {self.current_turn_id} (its prompt request was not in flight)")
            self._end_turn(self.current_turn_id, "error", "the control server re-executed and could not match"
                           " this turn's answer")

    def _resume_sandbox_init(self, h: InstanceHandover) -> None:
        """A sandboxed agent: bwrap's init as the previous image knew it, if that process is still
        the same one (pid and start time); else found again from bwrap, as after a launch."""
        if not self.spec.sandboxed:
            return
        if h.sandbox_init_pid is not None:
            try:
                init = psutil.Process(h.sandbox_init_pid)
                if init.create_time() == h.sandbox_init_start_time:
                    self._sandbox_init = init
            except psutil.Error:
                pass  # exited (and reaped) meanwhile: the sandbox is gone
        self._find_sandbox_init()


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


async def _prompt_response(answer: asyncio.Future[Any]) -> PromptResponse:
    return PromptResponse.model_validate(await answer)


async def _discard_answer(instance_id: str, method: str, answer: asyncio.Future[Any]) -> None:
    with contextlib.suppress(Exception):
        await answer
    log.warning("instance %s: the answer to %s sent before the re-exec arrived; nobody waits for it",
                instance_id, method or "a request")


class _HandshakeRefused(Exception):
    """The agent answered the handshake with something we cannot use."""


async def _wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Return when one of ``events`` is set or after ``timeout`` s."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _dump(model: Any) -> Any:
    if model is None:
        return None
    if hasattr(model, "model_dump"):
        return model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return model


def _dump_list(items: Any) -> list[Any]:
    return [_dump(i) for i in items or []]


def session_info(response: Any) -> dict[str, Any]:
    """The modes and config options an ACP session/new|load answer reported, as JSON."""
    return {
        "modes": _dump(getattr(response, "modes", None)),
        "config_options": _dump_list(getattr(response, "config_options", None)),
    }


def _rpc_key(rpc_id: Any) -> str:
    return json.dumps(rpc_id, sort_keys=True, default=str)


def _rpc_error_text(exc: RequestError) -> str:
    text = str(exc) or "error"
    data = getattr(exc, "data", None)
    if data:
        with contextlib.suppress(TypeError, ValueError):
            text = f"{text} ({json.dumps(data)[:500]})"
    return text
