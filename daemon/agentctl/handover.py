"""The control server's whole state, as one process image hands it to the next (re-exec).

A reload (``systemctl reload kandev-agentctl``, ``kandev agentctl reload``; see
``daemon.agentctl.reload.reexec``) quiesces the server, captures a ``ServerHandover``,
encodes it with msgpack into a sealed memfd, and ``execve``s the installed code
with ``--resume-state-fd N``; the new image decodes it and resumes
(``daemon.agentctl.reload.resume``). Same pid, so the agents (our children, with
``PR_SET_PDEATHSIG`` relative to the main thread) notice nothing.

What travels, and why it is enough to resume without losing or repeating anything:

- server: identity (turn ids and proofs depend on it), the turn counter, the
  launch settings, the last agent-sandbox probe, the listening socket (an fd kept open across the exec: clients
  that connect meanwhile wait in its backlog) and its file identity, ownership
  (the acceptable credentials themselves, rotation state, bootstrap flag, last
  renewal and start on ``CLOCK_MONOTONIC``, which is one clock per boot and so the
  same on both sides of an exec), and the reload history shown by ``identify``.
- per instance: every field of its ``InstanceSpec`` (generic: a field added later
  travels without code here), process identity and group, state, exit status if
  the process was already reaped, the ACP session and what the agent reported
  about it, the event log (next seq, every retained event), retained turn outcomes,
  the open turn, the JSON-RPC requests in flight to the agent with the SDK's next
  request id, the agent's open permission requests (with the raw JSON-RPC request,
  replayed into the new connection without a new event), the agent's stdout pipe
  and stdin pipe fds, and the bytes already read from stdout but not yet handed to
  the connection (a message held back by the detached bound, a partial line, the
  reader's buffer); for a sandboxed agent, bwrap's init in its pid namespace
  (pid and start time). The sandbox itself needs nothing more: its bwrap is the
  agent's process-group leader, our child like any agent, and its
  ``launch_argv`` is part of the spec.

Secrets (credentials, the agents' environments) live only in the memfd: never in
a file, argv, the environment or a log line. The agents' keys (``InstanceSpec.secret_env``,
Issue 12) do not travel at all: the server drops them once the agent is spawned with them
(``instance.SPEC_NOT_HANDED_OVER``).

Decoding is strict about what the new code needs (a missing field without a
default, or a value of the wrong type, fails the decode, so preflight refuses the
reload) and honest about what it cannot use: a field the new code does not know
is listed in ``lost`` (server level) or the instance's ``not_taken_over``, which
``list_instances`` and the journal report, instead of being dropped silently.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, TypeVar, Union

import msgpack

from daemon.agentctl.sandbox.bubblewrap import SandboxSupport
from daemon.host.memfd import sealed_memfd

HANDOVER_FORMAT = 1
"""Bumped only for an incompatible change; fields are otherwise only ever added."""
MEMFD_NAME = "kandev-agentctl-handover"

T = TypeVar("T")


class HandoverError(ValueError):
    """The serialized state cannot be taken over; the message says where."""


# ---------------------------------------------------------------- the state


@dataclass
class PermissionHandover:
    """An open ``session/request_permission`` of the agent, awaiting our JSON-RPC answer."""

    request_id: str  # our id, as in the permission_request event
    option_ids: list[str]
    turn_id: str | None
    tool_call_id: str
    message: dict[str, Any]  # the agent's JSON-RPC request as it arrived (its "id" is the agent's)


@dataclass
class RequestHandover:
    """A JSON-RPC request we sent to the agent whose answer has not arrived yet."""

    rpc_id: int
    method: str
    turn_id: str | None = None  # set for the session/prompt whose answer ends that turn


@dataclass
class InstanceHandover:
    spec: dict[str, Any]  # every field of InstanceSpec, by name
    state: str
    pid: int | None
    pid_start_time: float | None
    exit_code: int | None
    reaped_returncode: int | None  # reaped before the exec; its exit may not be reported yet
    acp_session_id: str | None
    session_info: dict[str, Any]
    handshake_seq: int
    detached_event_limit: int
    limit_armed: bool
    current_turn_id: str | None
    outcomes: list[dict[str, Any]]
    next_seq: int
    events: list[list[Any]]  # [seq, kind, data], oldest first
    stdout_fd: int | None
    stdin_fd: int | None
    unread: bytes
    next_request_id: int
    requests: list[RequestHandover]
    permissions: list[PermissionHandover]
    stderr_path: str
    not_taken_over: list[str] = field(default_factory=list)
    # A sandboxed agent: bwrap's init in the agent's pid namespace (the group leader's child), by
    # pid and start time, so a stop after the exec still knows when the sandbox is gone even if
    # bwrap itself was reaped first (``Instance.group_alive``).
    sandbox_init_pid: int | None = None
    sandbox_init_start_time: float | None = None
    # Both starts in clock ticks since boot (``daemon.host.process_start``), which a step of the wall
    # clock cannot move; None: an image before 0.3.0 (the start times are compared instead).
    pid_start_ticks: int | None = None
    sandbox_init_start_ticks: int | None = None
    # The read end of the agent's stderr pipe (``stderr_drain.StderrSink``); None: an image before
    # 0.3.0, whose agents write their stderr file themselves.
    stderr_fd: int | None = None


@dataclass
class OwnershipHandover:
    credentials: list[list[Any]]  # [credential id, 32 bytes]
    highest: int
    confirmed: bool
    bootstrapped: bool
    started_at: float  # CLOCK_MONOTONIC
    last_renewal: float  # CLOCK_MONOTONIC
    period_s: float


@dataclass
class ReloadHistory:
    """What ``identify`` reports about reloads; survives every exec of one server lifetime."""

    started_at: float  # wall clock of the first start of this lifetime (time.time())
    reexec_count: int = 0
    last_reexec_at: float | None = None  # wall clock
    last_from_version: str | None = None
    last_pause_ms: float | None = None  # quiesce to serving again, as measured by the new image
    attempts: int = 0
    last_attempt: int = 0
    last_outcome: str | None = None  # "reexecuted" | "refused"
    last_reason: str | None = None
    last_outcome_at: float | None = None


@dataclass
class ServerHandover:
    format: int
    from_version: str
    pid: int
    server_identity: str
    launch: dict[str, Any]  # LaunchConfig fields
    unowned_period_s: float
    detached_event_limit: int
    turn_counter: int
    listen_fd: int
    socket_path: str
    socket_identity: list[int]  # st_dev, st_ino of the socket file
    ownership: OwnershipHandover
    reload: ReloadHistory
    instances: list[InstanceHandover]
    quiesced_at: float  # CLOCK_MONOTONIC, for the pause the new image measures
    lost: list[str] = field(default_factory=list)
    # The last sandbox probe (None: none finished): the new image answers sandbox_status and
    # launches with it at once, and probes again when the old code would have (it said no).
    sandbox_support: SandboxSupport | None = None

    def fds(self) -> list[int]:
        """Every fd this state names; each must be inherited across the exec."""
        fds = [self.listen_fd]
        for inst in self.instances:
            fds.extend(fd for fd in (inst.stdout_fd, inst.stdin_fd, inst.stderr_fd) if fd is not None)
        return fds


# ---------------------------------------------------------------- plain values


def to_plain(value: Any) -> Any:
    """A value as msgpack carries it: dataclasses as maps, enums by value, tuples as lists, paths as str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return to_plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_plain(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def from_plain(tp: Any, value: Any, where: str, lost: list[str]) -> Any:
    """``value`` (plain) as an instance of the annotation ``tp``; raise HandoverError if it is not one."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return from_plain(option, value, where, lost)
            except HandoverError as exc:
                errors.append(str(exc))
        raise HandoverError(errors[0] if len(errors) == 1 else f"{where}: {value!r:.60} fits none of {tp}")
    if origin in (list, tuple, set, frozenset):
        if not isinstance(value, list):
            raise HandoverError(f"{where}: expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [from_plain(item, v, f"{where}[{i}]", lost) for i, v in enumerate(value)]
        return items if origin is list else origin(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise HandoverError(f"{where}: expected a map, got {type(value).__name__}")
        args = typing.get_args(tp)
        key_t, val_t = args if args else (Any, Any)
        return {from_plain(key_t, k, f"{where} key", lost): from_plain(val_t, v, f"{where}[{k!r}]", lost)
                for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_fields(tp, value, where, lost)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise HandoverError(f"{where}: {value!r:.60} is not a {tp.__name__}") from None
    if isinstance(tp, type) and issubclass(tp, PurePath):
        if not isinstance(value, str):
            raise HandoverError(f"{where}: expected a path string")
        return tp(value)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise HandoverError(f"{where}: expected a number, got {type(value).__name__}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise HandoverError(f"{where}: expected a whole number, got {type(value).__name__}")
    if tp in (str, bytes, bool, dict, list):
        if isinstance(value, tp):
            return value
        raise HandoverError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    raise HandoverError(f"{where}: cannot take over a value of type {_type_name(tp)}")


def from_fields(cls: type[T], value: Any, where: str, lost: list[str]) -> T:
    """Build the dataclass ``cls`` from a map of its fields. Unknown keys are listed in ``lost``
    (never their values: they may be secrets); a missing field without a default is an error."""
    if not isinstance(value, dict):
        raise HandoverError(f"{where}: expected a map, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for name, f in known.items():
        if name in value:
            kwargs[name] = from_plain(hints[name], value[name], f"{where}.{name}", lost)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise HandoverError(f"{where}: field {name!r} is missing")
    for name in value:
        if name not in known:
            lost.append(f"{where}.{name} (not known to this version)")
    return cls(**kwargs)


# ---------------------------------------------------------------- the codec


def encode(state: ServerHandover) -> bytes:
    data: bytes = msgpack.packb(to_plain(state), use_bin_type=True)
    return data


def decode(data: bytes) -> ServerHandover:
    """Parse and check a serialized state. Raises HandoverError."""
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise HandoverError(f"the state is not valid msgpack: {exc}") from None
    if not isinstance(doc, dict):
        raise HandoverError("the state is not a map")
    fmt = doc.get("format")
    if fmt != HANDOVER_FORMAT:
        raise HandoverError(f"state format {fmt!r} is not {HANDOVER_FORMAT}, the one this version reads")
    lost: list[str] = []
    state = from_fields(ServerHandover, doc, "server", lost)
    # Instance-level leftovers belong to their instance; the rest is the server's.
    for i, inst in enumerate(state.instances):
        prefix = f"server.instances[{i}]."
        inst.not_taken_over.extend(item[len(prefix):] for item in lost if item.startswith(prefix))
    state.lost.extend(item for item in lost if not item.startswith("server.instances["))
    return state


# ---------------------------------------------------------------- the memfd


def write_memfd(data: bytes) -> int:
    """A sealed memfd holding ``data`` (close-on-exec; the exec path makes it inheritable; the new
    image reads it with ``read_memfd``, at offsets)."""
    return sealed_memfd(MEMFD_NAME, data)


def read_memfd(fd: int) -> bytes:
    """The whole content of ``fd``, read at offsets (the shared file position is never moved)."""
    size = os.fstat(fd).st_size
    chunks: list[bytes] = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
