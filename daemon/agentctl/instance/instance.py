"""One instance: the small object that owns one agent's rooms and its state table.

State machine (supervisord-style; every change goes through ``_set_state``)::

    starting --(initialize + session/new|load answered)--> running
    starting --(handshake failed: group killed)----------> stopping --> stopped
    starting|running --(agent process exited)-----------> exited
    starting|running|exited --(stop())-------------------> stopping --> stopped

``exited`` instances stay listed (with their exit code, retained events and turn outcomes) until
``stop()``; ``stopped`` is final and the server forgets the instance.

The rooms (docs/architecture.md#the-control-server-inside), each in its own module:

- what runs: ``agent_process`` (the spec, spawn, environment, identity, signals, the kill);
- the output path: ``agent_pipe`` (the agent's stdout, paused by the detached bound) into
  ``events.EventLog`` (retention, acks), its stderr through ``stderr_drain.StderrSink``;
- the conversation: ``conversation`` (the ACP handshake and bounded requests, ``Turns``,
  ``Permissions``, ``TurnIds``);
- the hand-over to the next process image: ``instance_handover``.

This module keeps what ties them together: the ACP connection and its observer, which the SDK
calls synchronously in arrival order (``session/update`` notifications and
``session/request_permission`` requests become events there, with ``data`` taken from the raw
JSON-RPC message), prompts and cancels, runtime configuration (the RESETCFG rules: ``set_mode``,
``set_config_option`` and ``reset_context`` answer ``last_seq``, every update the agent sent
before answering being numbered by then), and the exit and stop sequences. An agent killed by a
signal nobody here sent (the OOM killer, a stray ``kill``) is reported as such: ``agent_exited``
carries the ``signal`` and the journal says ``agent_killed``. ``stop()`` never blocks for ever.

Turns: ``prompt`` opens a turn with a server-wide unique id and appends ``turn_started``; when the
agent answers, ``turn_ended`` is appended after every ``session_update`` it sent before its answer
and the outcome is retained until ``ack_turn`` names it (AC-EXECUTORS-SURVIVAL-004.1,
AC-EXECUTORS-SURVIVAL-004.6).

Detached retention (AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6,
AC-EXECUTORS-SURVIVAL-001.9, AC-EXECUTORS-SURVIVAL-001.10; the rule is in
``daemon.agentctl.instance.events``): a full detached log holds the agent's next message back in
``AgentPipeTransport`` and the agent blocks in its own write. The bound is armed once the
handshake is done; ``attach`` and acks release the producer; ``stop()`` closes the log first,
releasing every parked producer at once; ``agent_exited`` is appended only once stdout is
drained. Why this holds: docs/architecture.md#the-control-server-inside, "How the pause is built".
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import acp
from acp.connection import StreamDirection, StreamEvent
from acp.exceptions import RequestError
from acp.schema import AllowedOutcome, DeniedOutcome, RequestPermissionResponse

from daemon.agentctl.instance import conversation, stderr_drain
from daemon.agentctl.instance import logs as agent_logs
from daemon.agentctl.instance.conversation import Permissions, Turns, rpc_error_text, rpc_key
from daemon.agentctl.instance.events import EventLog, Subscription
from daemon.agentctl.instance.pipe import AgentPipeTransport, drain, wait_any
from daemon.agentctl.instance.process import (
    REAP_TIMEOUT,
    AgentProcess,
    InstanceSpec,
    close_launch_fds,
    killed_by,
)
from daemon.agentctl.protocol import EventKind
from daemon.core.journal import log_event
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.agentctl.instance")

HANDSHAKE_TIMEOUT = 60.0
"""Seconds each of ``initialize`` and ``session/new|load`` may take. A real npm agent's cold start
is CPU-bound (OpenCode's and Gemini CLI's answer to ``initialize`` took 25 to 40 s on a busy
two-core host, 4 to 5 s on an idle one): the bound catches an agent that will never answer, not
a slow machine."""
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
DEFAULT_DETACHED_EVENT_LIMIT = 100
"""The ``agentctl.detached_event_limit`` default; the server passes the validated setting."""


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


# ---------------------------------------------------------------- ACP client side


class _AcpClient:
    """What the agent may call on us: session updates (numbered by the observer) and permissions."""

    def __init__(self, instance: Instance) -> None:
        self._instance = instance

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        return None  # never called: the transport hands session/update to Instance._on_update

    async def request_permission(
        self, session_id: str, tool_call: Any, options: list[Any], **kwargs: Any
    ) -> RequestPermissionResponse:
        option_id = await self._instance.permissions.answer(str(tool_call.tool_call_id))
        if option_id is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id=option_id))


# ---------------------------------------------------------------- the instance


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
        self.group = AgentProcess(spec.sandboxed)  # the agent's process group and its identity
        self.acp_session_id: str | None = None
        # What the agent reported for its current ACP session (session/new|load, reset_context):
        # {"modes": <SessionModeState JSON>|None, "config_options": [<config option JSON>]}.
        self.session_info: dict[str, Any] = {"modes": None, "config_options": []}
        self.handshake_seq = 0  # last seq appended during the handshake (e.g. a session/load replay)
        self._last_incoming = time.monotonic()  # when the agent last sent a message (LOAD_SETTLE)
        self.exit_code: int | None = None
        self.log = EventLog()  # unbounded until the handshake is done (see the module docstring)
        self.turns = Turns(self.log)
        self.permissions = Permissions(self.log)
        self.detached_event_limit = detached_event_limit
        self.stop_signal = asyncio.Event()  # set first thing by stop(); every blocking wait watches it
        self.stderr_path = Path(agent_log_dir) / f"{spec.instance_id}.stderr.log"
        self._agent_log_dir = Path(agent_log_dir)
        self._turn_ids = turn_ids
        self._on_change = on_change
        self.handshake_timeout = handshake_timeout
        self.stderr_sink: stderr_drain.StderrSink | None = None  # None: the agent writes its file itself (older image)
        self.stderr_handover_fd: int | None = None  # the stderr pipe while a re-exec is being prepared
        self.transport: AgentPipeTransport | None = None
        self.conn: acp.ClientSideConnection | None = None
        self._exit_task: asyncio.Task[None] | None = None
        self.prompt_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Future[None] | None = None
        self.exited = asyncio.Event()
        self.incoming_open: dict[str, str] = {}  # the agent's requests we have not answered: rpc key -> method
        self.not_taken_over: list[str] = []  # what a re-exec could not carry over (reported by describe)
        self.reading_paused_for_handover = False  # daemon.agentctl.reload.instance_handover
        self.pipe_paused_for_handover = False

    # -- reporting -----------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.group.pid

    @property
    def process(self) -> Any:
        """The agent's process handle (``asyncio.subprocess.Process`` or ``AdoptedProcess``), or None."""
        return self.group.proc

    @property
    def current_turn_id(self) -> str | None:
        return self.turns.current

    def describe(self) -> dict[str, Any]:
        """The enumeration entry (AC-EXECUTORS-SURVIVAL-002.1): never the environment."""
        return {
            "instance_id": self.instance_id,
            "session_id": self.spec.session_id,
            "task_id": self.spec.task_id,
            "agent": self.spec.agent,
            "pid": self.pid,
            "pid_start_time": self.group.pid_start_time,
            "pid_start_stamp": self.group.pid_start_stamp,
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

    async def spawn(self) -> None:
        """Start the agent's process (``AgentProcess.spawn``) and its stderr sink."""
        stderr_read = await self.group.spawn(self.spec, self._agent_log_dir)
        self.start_stderr_sink(stderr_read)

    def start_stderr_sink(self, read_fd: int) -> None:
        self.stderr_handover_fd = None
        self.stderr_sink = stderr_drain.StderrSink(read_fd, self.stderr_path).start()

    def connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> acp.ClientSideConnection:
        """The ACP connection over the agent's pipes, and the watch of its exit."""
        self.transport = AgentPipeTransport(reader, writer, self._on_garbage, self.log, self._on_update)
        self._exit_task = asyncio.create_task(self._watch_exit(), name=f"agentctl.exit.{self.instance_id}")
        self.conn = acp.connect_to_agent(_AcpClient(self), self.transport, observers=[self._observe])  # type: ignore[arg-type]  # partial acp.Client: acp answers method_not_found for the rest
        return self.conn

    async def start(self) -> None:
        """Spawn the agent and run the ACP handshake; on failure the group is killed and
        ``IpcError(agent_error)`` says why (exit code and stderr tail when the agent died)."""
        await self.spawn()
        proc = self.group.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        if self.gone:  # stopped while the process was being created
            self.group.signal_group(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await within(proc.wait(), REAP_TIMEOUT)
            raise IpcError(ErrorCode.SHUTTING_DOWN, f"instance {self.instance_id} was stopped while starting")
        conn = self.connect(proc.stdout, proc.stdin)
        handshake = conversation.Handshake()
        try:
            await handshake.run(conn, self.spec.cwd, self.spec.resume_session_id, self.handshake_timeout,
                                self._settle_replay)
        except asyncio.CancelledError:
            await self.stop()
            raise
        except Exception as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, await self._handshake_failure(handshake.step, exc),
                           retryable=False) from None
        finally:
            if handshake.acp_session_id is not None:
                self.acp_session_id, self.session_info = handshake.acp_session_id, handshake.session_info
        step = handshake.step
        if self.state is not InstanceState.STARTING:  # exited or stopped meanwhile
            raise IpcError(ErrorCode.AGENT_ERROR, await self._handshake_failure(step, None), retryable=False)
        self.handshake_seq = self.log.last_seq
        self.log.set_limit(self.detached_event_limit)  # the detached bound applies from now on
        self.group.find_sandbox_init()
        self._set_state(InstanceState.RUNNING)

    async def _settle_replay(self) -> None:
        """Wait until the agent has been quiet for ``LOAD_SETTLE`` seconds (at most the handshake
        timeout: an agent that never stops talking has not finished its load)."""
        deadline = time.monotonic() + self.handshake_timeout
        while True:
            if self.state is not InstanceState.STARTING or self.exited.is_set() or self.stop_signal.is_set():
                return  # exited or stopped meanwhile: start() reports it
            now = time.monotonic()
            quiet = now - self._last_incoming
            if quiet >= LOAD_SETTLE:
                return
            if now >= deadline:
                raise TimeoutError("the agent kept sending its history")
            await wait_any((self.stop_signal, self.exited), min(LOAD_SETTLE - quiet, deadline - now) + 0.01)

    async def _handshake_failure(self, step: str, exc: BaseException | None) -> str:
        """Kill the group and describe why the handshake failed."""
        reason = conversation.failure_reason(step, exc, self.handshake_timeout)
        if not self.gone:
            # Let an agent that is exiting by itself report its own exit code.
            with contextlib.suppress(TimeoutError):
                await within(self.exited.wait(), 0.5)
        exited_by_itself = self.exited.is_set() and not self.gone
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
        """Stream observer: called synchronously, in arrival order, for every JSON-RPC message but
        the ``session/update`` notifications (``_on_update``)."""
        message = event.message
        if event.direction is StreamDirection.OUTGOING:
            if "method" not in message and "id" in message:
                self.incoming_open.pop(rpc_key(message["id"]), None)
                self.permissions.answered(message["id"])
            return
        self._last_incoming = time.monotonic()
        method, params = message.get("method"), message.get("params")
        if method is not None and "id" in message:
            self.incoming_open[rpc_key(message["id"])] = str(method)
        if method == "session/request_permission" and "id" in message:
            self.permissions.requested(message["id"], params if isinstance(params, dict) else {}, message,
                                       self.current_turn_id)

    def _on_update(self, message: dict[str, Any]) -> None:
        """A ``session/update`` notification, in arrival order (the transport hands these here)."""
        self._last_incoming = time.monotonic()
        update = params.get("update") if isinstance(params := message.get("params"), dict) else None
        self.log.append(EventKind.SESSION_UPDATE, {"turn_id": self.current_turn_id, "update": update})

    def _on_garbage(self, line: str) -> None:
        self.log.append(EventKind.AGENT_ERROR, {"message": f"the agent wrote a line that is not JSON-RPC: {line}"})

    def respond_permission(self, request_id: str, option_id: str | None) -> None:
        self.permissions.respond(request_id, option_id)

    # -- turns ----------------------------------------------------------------

    def _require_running(self, what: str) -> acp.ClientSideConnection:
        if self.state is not InstanceState.RUNNING or self.conn is None:
            raise IpcError(ErrorCode.CONFLICT, f"cannot {what}: instance {self.instance_id} is {self.state.value}")
        return self.conn

    def prompt(self, text: str) -> str:
        """Open a turn and send the prompt; returns the turn id at once."""
        self._require_running("prompt")
        if self.current_turn_id is not None:
            raise IpcError(ErrorCode.CONFLICT, f"turn {self.current_turn_id} is still open on this instance")
        turn_id = self._turn_ids()
        self.turns.open(turn_id, text)
        self.prompt_task = asyncio.create_task(self._run_turn(turn_id, text), name=f"agentctl.turn.{turn_id}")
        return turn_id

    async def _run_turn(self, turn_id: str, text: str) -> None:
        conn = self.conn
        assert conn is not None and self.acp_session_id is not None
        await self.finish_turn(turn_id, conn.prompt(session_id=self.acp_session_id, prompt=[acp.text_block(text)]))

    async def finish_turn(self, turn_id: str, answer: Awaitable[Any]) -> None:
        """Await the agent's answer to the turn's session/prompt and end the turn with it."""
        try:
            response = await answer
        except asyncio.CancelledError:
            raise
        except RequestError as exc:
            self.end_turn(turn_id, "error", rpc_error_text(exc))
        except (ConnectionError, OSError) as exc:
            # The agent went away: the exit watcher ends the turn with agent_exited.
            with contextlib.suppress(TimeoutError):
                await within(self.exited.wait(), STDOUT_DRAIN_GRACE + 1.0)
            self.end_turn(turn_id, "error", f"lost the connection to the agent: {exc}")
        except Exception as exc:
            log.exception("instance %s: prompt failed", self.instance_id)
            self.end_turn(turn_id, "error", f"prompt failed: {exc}")
        else:
            self.end_turn(turn_id, str(response.stop_reason), None)

    def end_turn(self, turn_id: str, stop_reason: str, error: str | None) -> None:
        """Close the open turn (no-op if ``turn_id`` is not the open one) and retain its outcome."""
        self.turns.end(turn_id, stop_reason, error, retain=not self.gone)

    async def cancel(self) -> None:
        """ACP ``session/cancel``; open permission requests are answered ``cancelled`` (ACP rule)."""
        conn = self._require_running("cancel")
        assert self.acp_session_id is not None
        self.permissions.cancel_all("cancel")
        try:
            await conn.cancel(session_id=self.acp_session_id)
        except (ConnectionError, OSError) as exc:
            raise IpcError(ErrorCode.AGENT_ERROR, f"cannot reach the agent: {exc}") from None

    # -- runtime configuration and context reset (docs/requirements.md#runtime-configuration-across-a-context-reset) -------------------------

    async def _config_call(self, what: str, call: Callable[[acp.ClientSideConnection], Awaitable[Any]]) -> Any:
        """One ACP request on the current session; a refusal is ``agent_error`` (not retryable)."""
        return await conversation.request(self._require_running(what), what, call, self.handshake_timeout)

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
        options = conversation.dump_list(getattr(response, "config_options", None))
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
        self.session_info = conversation.session_info(session)
        return {"acp_session_id": self.acp_session_id, **self.session_info, "last_seq": self.log.last_seq}

    def turn_status(self) -> dict[str, Any]:
        """Pure read (AC-EXECUTORS-SURVIVAL-004.6): the open turn and every retained outcome."""
        return self.turns.status()

    def ack_turn(self, turn_id: str) -> bool:
        """Discard the retained outcome of ``turn_id``; False (and no change) if it is not held."""
        return self.turns.ack(turn_id)

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
        return agent_logs.tail(self.stderr_path, limit)

    async def _watch_exit(self) -> None:
        proc = self.group.proc
        transport = self.transport
        assert proc is not None and transport is not None
        code = await proc.wait()
        # Everything the agent wrote before dying is numbered before agent_exited.
        await self._drain_stdout(transport)
        if self.state in (InstanceState.STARTING, InstanceState.RUNNING):
            await self._stderr_settled()
        self.exit_code = code
        self.exited.set()
        if self.state in (InstanceState.STARTING, InstanceState.RUNNING):
            sig = None if self.group.stopped_by_us else killed_by(code, self.spec.sandboxed)
            data: dict[str, Any] = {"exit_code": code, "stderr_tail": self.stderr_tail()}
            if sig is not None:
                data["signal"] = sig.name
            self.log.append(EventKind.AGENT_EXITED, data)
            how = f"was killed by {sig.name}" if sig is not None else f"exited with code {code}"
            if self.current_turn_id is not None:
                self.end_turn(self.current_turn_id, "agent_exited", f"the agent {how}")
            self.permissions.cancel_all("agent_exited")
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
        """Everything the exited agent wrote to stdout, or up to ``STDOUT_DRAIN_GRACE`` s of reading."""
        if not await drain(transport, lambda: self.log.paused, self.stop_signal, STDOUT_DRAIN_GRACE):
            log.warning("instance %s: the agent's stdout is still open %g s after its exit",
                        self.instance_id, STDOUT_DRAIN_GRACE)

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
        self.stop_signal.set()
        self.log.close()  # ends the attached stream, drops undelivered events, unparks producers
        previous = self.state
        self._set_state(InstanceState.STOPPING)
        self.permissions.cancel_all("stop")
        if self.prompt_task is not None and not self.prompt_task.done():
            self.prompt_task.cancel()
        ended_by = await self.group.kill_group()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await within(self.conn.close(), 2.0)
        if self._exit_task is not None and not self._exit_task.done():
            with contextlib.suppress(Exception):
                await within(asyncio.shield(self._exit_task), STDOUT_DRAIN_GRACE + 1.0)
            self._exit_task.cancel()
        if self.group.returncode is not None:
            self.exit_code = self.group.returncode
        close_launch_fds(self.spec)
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
