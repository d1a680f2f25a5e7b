"""The control server's operations over ``ipc.server.IpcServer`` with ``protocol.TABLE``.

Ownership (docs/architecture.md#ownership; the state machine is ``daemon.agentctl.ownership``):

- ``identify`` (unauthenticated) returns the per-launch ``server_identity``,
  the capability set, the protocol version and the unowned period, and no
  path of any kind (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11).
- ``prove`` answers the backend's fresh 32-byte challenge with
  ``auth.server_proof`` for each acceptable credential (AC-EXECUTORS-CONTROL-OWNERSHIP-001.10).
- ``auth_begin`` / ``auth_finish`` authenticate one connection with an HMAC
  over a fresh server nonce; a failed ``auth_finish`` consumes the nonce and
  leaves the connection unauthenticated. The connection remembers WHICH
  credential authenticated it; its power is judged at each request: the
  current credential may do everything, the superseded one (a rotation not yet
  confirmed) only ``rotate`` and ``ownership_shutdown``, anything else gets
  ``superseded_credential`` (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6, AC-EXECUTORS-CONTROL-OWNERSHIP-002.7).
  Every op declared ``auth=True`` is refused with ``unauthenticated`` on a
  connection that has not authenticated.
- ``rotate`` / ``confirm_rotation``: the two-phase switch. When a credential
  stops authenticating anything (a confirmation, or a rotation past an
  unconfirmed one) every connection and stream authenticated under it is
  aborted at once (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2).
- ``claim``, a rotation (replay included) and the bootstrap (the first
  authentication with the launch credential) renew ownership; nothing else
  does (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8). ``run_unowned_timer`` takes the unowned-shutdown decision once
  ``now - last_renewal >= period`` and asks the process to exit (AC-EXECUTORS-CONTROL-OWNERSHIP-003.1).

Instances (docs/architecture.md#the-control-server-inside): see ``daemon.agentctl.instance``. Unknown instance
ids are ``not_found``, except for ``stop_instance``, where an absent instance
counts as stopped (``already_absent``).

Reload (Issue 15): ``reload`` (authenticated) starts a re-exec of the installed
code with this state handed over (``daemon.agentctl.reexec``); ``identify``
reports nothing new (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11: three things and no path); the authenticated
``server_info`` reports the running version, the pid and the reload history,
and so does a 0600 status file beside the socket, which the unit's reload helper
(no credential) follows to the reload's end. ``capture_handover`` / ``from_handover`` are the
server's side of the hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon import faults
from daemon.agent_user import AgentUserMissing
from daemon.agentctl import agent_env, agent_logs, auth, sandbox
from daemon.agentctl.handover import HANDOVER_FORMAT, ReloadHistory, ServerHandover, to_plain
from daemon.agentctl.instance import Instance, InstanceSpec, TurnIds
from daemon.agentctl.launch import LaunchConfig
from daemon.agentctl.ownership import Ownership
from daemon.agentctl.protocol import TABLE, TURN_STATUSES_MAX
from daemon.agentctl.sandbox import SandboxPolicy, SandboxRequest, SandboxSupport
from daemon.agents.settings import SettingsError
from daemon.config import ResolvedAgentctl
from daemon.journal import log_event
from daemon.limits import BUFFER_LIMIT, IDLE_CONNECTION_TIMEOUT_S, connection_limit
from daemon.version import VERSION
from ipc.aio import within
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.framing import ConnectionClosed
from ipc.schema import Op
from ipc.server import IpcServer

log = logging.getLogger("kandev.agentctl.server")

STREAM_BATCH = 256  # events an attach stream takes from the log for one send (bounded in bytes by the ipc layer)
_SHUTDOWN_REPLY_GRACE = 0.5  # seconds the ownership_shutdown reply gets before the process exits
_MAX_TEXT = 4 * 1024 * 1024


def _authenticated(ctx: ConnectionContext) -> bool:
    return ctx.state.get("authenticated") is True


def _bad(message: str) -> IpcError:
    return IpcError(ErrorCode.INVALID_ARGUMENT, message)


def _check_str(name: str, value: Any, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty) or "\0" in value:
        raise _bad(f"create_instance: '{name}' must be a non-empty string without NUL")
    return value


def _check_str_list(name: str, value: Any, *, allow_empty: bool) -> list[str]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise _bad(f"create_instance: '{name}' must be a{'' if allow_empty else ' non-empty'} list of strings")
    return [_check_str(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _check_env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad("create_instance: 'env' must be a map of strings")
    env: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise _bad("create_instance: every 'env' name must be a non-empty string without '=' or NUL")
        if not isinstance(v, str) or "\0" in v:
            raise _bad(f"create_instance: 'env' value of {k!r} must be a string without NUL")
        env[k] = v
    return env


class AgentctlServer:
    """All server state of one launch: ownership, instances, the IPC listener."""

    def __init__(
        self,
        config: LaunchConfig,
        resolved: ResolvedAgentctl,
        credential: bytes,
        *,
        on_instances_changed: Callable[[int], None] | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.server_identity = secrets.token_hex(16)
        self.installation_id = config.installation_id
        self.unowned_period_s = float(resolved.unowned_period)
        self.detached_event_limit = int(resolved.detached_event_limit)
        # Credentials, rotation and the unowned timer; a spawn without a handshake counts from
        # process start (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8).
        self.ownership = Ownership(credential, self.unowned_period_s, clock=time.monotonic)
        self.exit_requested = asyncio.Event()
        self.exit_reason: str | None = None
        self._shutdown_calls = 0  # ownership_shutdown handlers still to answer
        self.instances: dict[str, Instance] = {}
        self.turn_ids = TurnIds(self.server_identity)
        self._on_instances_changed = on_instances_changed
        self._handshake_timeout = handshake_timeout
        self._conn_counter = 0
        self._background: set[asyncio.Task[Any]] = set()
        # Whether agents can be sandboxed here (probed off the loop at start, again before a launch
        # while it says no, and after a sandboxed agent died of bwrap's own error; a re-exec hands
        # it over).
        self.sandbox_support: SandboxSupport | None = None
        self._sandbox_lock = asyncio.Lock()
        self.reload_history = ReloadHistory(started_at=time.time())
        self.reloader: Any = None  # daemon.agentctl.reexec.Reloader, set by main (None: reload refused)
        # Held around work done in threads (agent log bounds, sandbox probes): a re-exec takes it, so
        # no thread is half way through a file, or has a trial sandbox running, when the process
        # image is replaced (a thread's child would lose its parent-death tie with the thread).
        self.background_io = asyncio.Lock()
        handlers = {name: self._logged(name, getattr(self, f"op_{name}")) for name in TABLE.names}
        self.ipc = IpcServer(
            config.socket_path, TABLE, handlers, authorize=self._authorize, max_connections=connection_limit(),
            # The owner's authenticated connections (calls, claims, streams) may idle; nobody else's.
            idle_timeout=IDLE_CONNECTION_TIMEOUT_S, idle_exempt=_authenticated, buffer_limit=BUFFER_LIMIT,
        )

    # -- lifecycle -----------------------------------------------------------

    @property
    def shutting_down(self) -> bool:
        """The one-way latch (AC-EXECUTORS-CONTROL-OWNERSHIP-003.9): set by the unowned decision, ownership_shutdown or a signal."""
        return self.ownership.shutting_down

    @property
    def last_renewal(self) -> float:
        return self.ownership.last_renewal

    async def start(self) -> None:
        await self.probe_sandbox()
        await self.ipc.start()
        self.write_reload_status()
        self._spawn_background(self.run_unowned_timer())
        self._spawn_background(self.run_agent_log_bounds())

    async def probe_sandbox(self) -> SandboxSupport:
        """Probe (off the event loop) whether an agent sandbox can be made here; log a change."""
        async with self._sandbox_lock:
            async with self.background_io:  # the probe runs a trial bwrap from a worker thread
                support = await asyncio.to_thread(sandbox.probe)
            previous, self.sandbox_support = self.sandbox_support, support
            if previous is None or previous.available != support.available:
                log_event(
                    "sandbox_probe",
                    f"agent sandbox ({support.mechanism} {support.version or '?'}): "
                    + ("available" if support.available else f"unavailable: {support.reason}"),
                    priority=6 if support.available else 4,
                    AVAILABLE=int(support.available),
                    REASON=support.reason,
                    BWRAP=support.bwrap,
                )
            return support

    def _own_paths(self) -> list[str]:
        """What of this server no agent may see, even where it lies inside something bound: the
        socket directory, the logs (agents' stderr included), the credential and its directory."""
        return self.config.own_paths()

    async def _sandboxed_argv(self, request: SandboxRequest, command: list[str], cwd: str) -> sandbox.Launch:
        """The agent's argv inside its sandbox (and the descriptors bwrap inherits);
        ``sandbox_unavailable`` when none can be made."""
        support = self.sandbox_support
        if support is None or not support.available:
            support = await self.probe_sandbox()  # the host may have been fixed meanwhile
        if not support.available or support.bwrap is None:
            raise sandbox.unavailable(support.reason or "unknown")
        sandbox.hidden_ok(request, cwd, self._own_paths())
        try:
            return await asyncio.to_thread(sandbox.wrap_command, request, command, cwd, bwrap=support.bwrap,
                                           extra_hidden=self._own_paths(), own_ipc=support.ipc_namespace)
        except AgentUserMissing as exc:
            raise sandbox.unavailable(str(exc)) from None
        except ValueError as exc:
            raise _bad(f"create_instance: {exc}") from None
        except OSError as exc:
            raise sandbox.unavailable(f"cannot prepare the agent's user namespace: {exc}") from None

    async def run_agent_log_bounds(self) -> None:
        """Keep the agents' stderr files bounded (``agent_logs``): old files of instances this
        server does not run are pruned at start and hourly; running instances' files are capped
        about every minute."""
        directory = Path(self.config.agent_log_dir)
        last_prune: float | None = None
        while not self.shutting_down:
            if last_prune is None or time.monotonic() - last_prune >= agent_logs.PRUNE_EVERY_S:
                last_prune = time.monotonic()
                keep = {inst.stderr_path for inst in self.instances.values()}
                async with self.background_io:
                    removed = await asyncio.to_thread(agent_logs.prune, directory, keep)
                if removed:
                    log_event("agent_logs_pruned", f"removed {len(removed)} agent stderr file(s) of instances"
                              f" not running here and not written for {agent_logs.MAX_AGE_S // 86400} days",
                              COUNT=len(removed))
            for inst in list(self.instances.values()):
                if inst.stderr_sink is not None:
                    continue  # bounded while written (agent_logs.StderrSink)
                async with self.background_io:
                    dropped = await asyncio.to_thread(agent_logs.cap, inst.stderr_path)
                if dropped:
                    log_event("agent_log_truncated", f"instance {inst.instance_id}: cut {dropped} bytes of agent"
                              f" stderr (kept under {agent_logs.MAX_BYTES} bytes)", INSTANCE_ID=inst.instance_id,
                              DROPPED=dropped)
            await asyncio.sleep(agent_logs.CAP_EVERY_S)

    async def run_unowned_timer(self, interval: float = 1.0) -> None:
        """Check the unowned period about every ``interval`` s; on expiry latch and request the exit."""
        while True:
            if self.ownership.decide_unowned_shutdown():
                idle = time.monotonic() - self.ownership.last_renewal
                log_event(
                    "unowned_shutdown",
                    f"control server {self.server_identity}: no ownership renewal for {idle:.1f} s"
                    f" (unowned period {self.unowned_period_s:g} s): stopping {len(self.instances)}"
                    " instance(s) and exiting",
                    priority=4,
                    SERVER_IDENTITY=self.server_identity,
                    UNOWNED_PERIOD_S=f"{self.unowned_period_s:g}",
                    INSTANCES=len(self.instances),
                )
                self._request_exit("unowned_shutdown")
                return
            if self.shutting_down:
                return
            await asyncio.sleep(min(interval, max(self.ownership.remaining(), 0.01)))

    def _request_exit(self, reason: str) -> None:
        if self.exit_reason is None:
            self.exit_reason = reason
        self.exit_requested.set()

    async def stop_all(self) -> list[str]:
        """Stop every instance (in parallel; each stop is bounded); returns their ids."""
        instances = list(self.instances.values())
        results = await asyncio.gather(*(inst.stop() for inst in instances), return_exceptions=True)
        for inst, result in zip(instances, results, strict=True):
            if isinstance(result, BaseException):
                log.error("stopping instance %s failed: %r", inst.instance_id, result)
            self.instances.pop(inst.instance_id, None)
        self._changed()
        return [inst.instance_id for inst in instances]

    async def shutdown(self) -> list[str]:
        """Stop everything and close the socket (SIGTERM/SIGINT, ownership_shutdown, unowned shutdown)."""
        self.ownership.begin_shutdown(self.exit_reason or "signal")
        stopped = await self.stop_all()
        # An ownership_shutdown that arrived while stopping ("already stopping" counts as success)
        # gets to send its reply before the socket closes.
        deadline = time.monotonic() + _SHUTDOWN_REPLY_GRACE
        while self._shutdown_calls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await self.ipc.close()
        with contextlib.suppress(OSError):
            self.reload_status_path.unlink()
        for task in list(self._background):
            task.cancel()
        return stopped

    def _changed(self, _instance: Instance | None = None) -> None:
        if self._on_instances_changed is not None:
            try:
                self._on_instances_changed(len(self.instances))
            except Exception:
                log.exception("instance change callback failed")

    # -- plumbing ------------------------------------------------------------

    def _conn_id(self, ctx: ConnectionContext) -> int:
        conn_id = ctx.state.get("conn_id")
        if conn_id is None:
            self._conn_counter += 1
            conn_id = ctx.state["conn_id"] = self._conn_counter
        return conn_id

    def _logged(self, name: str, handler: Callable[[ConnectionContext, dict[str, Any]], Any]) -> Any:
        async def run(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            log.debug("conn %d (pid %d) op %s", self._conn_id(ctx), ctx.peer.pid, name)
            return await handler(ctx, args)

        return run

    def _authorize(self, ctx: ConnectionContext, op: Op) -> None:
        if ctx.state.get("authenticated") is not True:
            log.debug("conn %d (pid %d) op %s refused: unauthenticated", self._conn_id(ctx), ctx.peer.pid, op.name)
            raise IpcError(
                ErrorCode.UNAUTHENTICATED,
                f"{op.name} needs an authenticated connection (prove, then auth_begin and auth_finish)",
            )
        try:
            # The op name is the purpose: only rotate and ownership_shutdown accept the superseded one.
            self.ownership.check(ctx.state.get("cred_id"), op.name)
        except IpcError:
            log.debug("conn %d (pid %d) op %s refused: superseded credential", self._conn_id(ctx), ctx.peer.pid,
                      op.name)
            raise

    def _cut(self, cred_ids: frozenset[int], why: str) -> int:
        """Abort every connection and stream authenticated under one of ``cred_ids`` (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2)."""
        if not cred_ids:
            return 0
        cut = 0
        for conn in self.ipc.connections:
            if conn.state.get("authenticated") is True and conn.state.get("cred_id") in cred_ids:
                conn.state["authenticated"] = False
                log.debug("conn %d: closed (%s)", self._conn_id(conn), why)
                conn.abort()  # not close(): nothing still queued for the old holder is delivered
                cut += 1
        return cut

    def _get(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or inst.gone:
            raise IpcError(ErrorCode.NOT_FOUND, f"no instance {instance_id!r}")
        return inst

    def _refuse_if_shutting_down(self, op: str) -> None:
        if self.shutting_down:
            raise IpcError(ErrorCode.SHUTTING_DOWN, f"{op}: the control server is shutting down")

    def _spawn_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- ownership -----------------------------------------------------------

    async def op_identify(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "server_identity": self.server_identity,
            "capabilities": [c for c in TABLE.capabilities
                             if not (c == "turns.v1" and faults.active("agentctl_lacks_turns"))],
            "protocol_version": list(TABLE.version),
            "unowned_period_s": self.unowned_period_s,
        }

    def reload_status(self) -> dict[str, Any]:
        """``{version, pid, reload: {...history, in_progress}}``: ``server_info`` and the status file."""
        status = to_plain(self.reload_history)
        status["in_progress"] = self.reloader is not None and self.reloader.in_progress
        return {"version": VERSION, "pid": os.getpid(), "reload": status}

    @property
    def reload_status_path(self) -> Path:
        """Where the reload status is written for ``kandev-agentctl --reload`` (which holds no
        credential): beside the socket, in the server's private run directory."""
        return Path(self.config.socket_path + ".reload.json")  # reload_client.STATUS_SUFFIX

    def write_reload_status(self) -> None:
        """Rewrite the status file (small, atomic); a failure is logged, never fatal."""
        path = self.reload_status_path
        data = json.dumps(self.reload_status(), sort_keys=True).encode("utf-8") + b"\n"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write the reload status file %s: %s", path, exc)

    async def op_server_info(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return self.reload_status()

    # -- reload (Issue 15; daemon.agentctl.reexec) -----------------------------

    async def op_reload(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self._refuse_if_shutting_down("reload")
        if self.reloader is None:
            raise IpcError(ErrorCode.CONFLICT, "reload: this server was started without re-exec support")
        attempt = self.reloader.request(f"reload op from pid {ctx.peer.pid}")
        return {"attempt": attempt, "version": VERSION, "pid": os.getpid()}

    def capture_handover(self, *, listen_fd: int, quiesced_at: float, attempt: int) -> ServerHandover:
        """The whole server, for the next process image (synchronous: nothing moves meanwhile)."""
        identity = self.ipc.identity
        history = ReloadHistory(**to_plain(self.reload_history))
        history.last_attempt = attempt
        return ServerHandover(
            format=HANDOVER_FORMAT,
            from_version=VERSION,
            pid=os.getpid(),
            server_identity=self.server_identity,
            launch=to_plain(self.config),
            unowned_period_s=self.unowned_period_s,
            detached_event_limit=self.detached_event_limit,
            turn_counter=self.turn_ids.counter,
            listen_fd=listen_fd,
            socket_path=self.ipc.path,
            socket_identity=list(identity) if identity is not None else [],
            ownership=self.ownership.snapshot(),
            reload=history,
            instances=[inst.handover_state() for inst in self.instances.values()],
            quiesced_at=quiesced_at,
            sandbox_support=self.sandbox_support,
        )

    @classmethod
    def from_handover(
        cls,
        state: ServerHandover,
        config: LaunchConfig,
        resolved: ResolvedAgentctl,
        *,
        on_instances_changed: Callable[[int], None] | None = None,
    ) -> AgentctlServer:
        """The server of the previous process image, instances included (pipes not yet taken
        back: ``start_handed_over``)."""
        ownership = Ownership.from_snapshot(state.ownership, clock=time.monotonic)
        server = cls(config, resolved, ownership.current_credential(),
                     on_instances_changed=on_instances_changed)
        server.server_identity = state.server_identity
        server.ownership = ownership
        server.turn_ids = TurnIds(state.server_identity, state.turn_counter)
        server.reload_history = state.reload
        # The previous image's probe answered for what that code's sandbox needed (0.2.0's had no
        # IPC namespace) under the restrictions of the unit this process started with: kept only
        # until this image's own probe, started at once by start_handed_over, replaces it.
        server.sandbox_support = state.sandbox_support
        for h in state.instances:
            inst = Instance.from_handover(h, agent_log_dir=Path(config.agent_log_dir), turn_ids=server.turn_ids,
                                          on_change=server._changed)
            server.instances[inst.instance_id] = inst
        return server

    async def start_handed_over(self, state: ServerHandover, listener: Any) -> None:
        """Take the agents' pipes back, then serve on the inherited listening socket."""
        for inst, h in zip(list(self.instances.values()), state.instances, strict=True):
            try:
                await inst.resume_pipes(h)
            except Exception as exc:  # one instance's pipes never cost the others theirs
                log.exception("instance %s: cannot take its agent's pipes back", inst.instance_id)
                inst.not_taken_over.append(f"the agent's pipes ({type(exc).__name__}: {exc}); the agent still"
                                           " runs and stop_instance ends it")
        identity = state.socket_identity
        await self.ipc.start_on(listener, (identity[0], identity[1]) if len(identity) == 2 else None)
        self._spawn_background(self.run_unowned_timer())
        self._spawn_background(self.run_agent_log_bounds())
        self._spawn_background(self.probe_sandbox())  # what this code's sandbox needs, under this unit
        self._changed()

    async def op_prove(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        challenge = args["challenge"]
        if len(challenge) != auth.CHALLENGE_BYTES:
            raise _bad(f"prove: the challenge must be {auth.CHALLENGE_BYTES} bytes, not {len(challenge)}")
        return {"proofs": self.ownership.prove(challenge, self.server_identity, self.installation_id)}

    async def op_auth_begin(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        nonce = auth.new_challenge()
        ctx.state["nonce"] = nonce
        return {"nonce": nonce}

    async def op_auth_finish(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        cred_id = self._authenticate(ctx, args["proof"], "auth_finish")
        role = self.ownership.role(cred_id)
        if self.ownership.bootstrap(cred_id):
            log.info("conn %d: bootstrap handshake with the launch credential (ownership renewed)",
                     self._conn_id(ctx))
        log.debug("conn %d: authenticated (%s credential)", self._conn_id(ctx), role)
        return {"credential": role}

    def _authenticate(self, ctx: ConnectionContext, proof: Any, op: str) -> int:
        """Check ``proof`` against this connection's pending nonce (consumed: one attempt per nonce).

        Success: the connection is authenticated under the matching credential (its id is kept).
        Failure: the connection is left unauthenticated, whatever it was before.
        """
        nonce = ctx.state.pop("nonce", None)
        ctx.state["authenticated"] = False
        ctx.state.pop("cred_id", None)
        if nonce is None:
            raise IpcError(ErrorCode.UNAUTHENTICATED, f"{op} without a pending auth_begin nonce")
        cred_id = self.ownership.match_connection_proof(nonce, self.server_identity, proof)
        if cred_id is None:
            log_event(
                "agentctl_auth_failed",
                f"a connection from pid {ctx.peer.pid} failed authentication ({op})",
                priority=4,
                PEER_PID=ctx.peer.pid,
                PEER_UID=ctx.peer.uid,
            )
            raise IpcError(ErrorCode.UNAUTHENTICATED, "authentication failed")
        ctx.state["authenticated"] = True
        ctx.state["cred_id"] = cred_id
        return cred_id

    async def op_rotate(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await faults.delay("agentctl_slow_rotate")  # test fault, off unless $KANDEV_FAULT says so
        if "proof" in args:
            self._authenticate(ctx, args["proof"], "rotate")
        elif ctx.state.get("authenticated") is not True:
            raise IpcError(ErrorCode.UNAUTHENTICATED, "rotate needs an authenticated connection or a proof")
        faults.hit("agentctl_rotate_fails")  # test fault, off unless $KANDEV_FAULT says so
        rotation = self.ownership.rotate_as(ctx.state.get("cred_id"))
        cut = self._cut(rotation.cut, f"rotation {rotation.rotation_id} left its credential no power")
        log_event(
            "ownership_rotated",
            f"credential rotation {rotation.rotation_id}"
            f" {'replayed (same rotation, nothing changed)' if rotation.replay else 'issued, awaiting confirmation'}"
            f" for pid {ctx.peer.pid}{f'; closed {cut} connection(s)' if cut else ''}",
            ROTATION_ID=rotation.rotation_id,
            REPLAY=int(rotation.replay),
            PEER_PID=ctx.peer.pid,
        )
        # The only time a credential crosses the socket (docs/architecture.md#ownership).
        return {"rotation_id": rotation.rotation_id, "credential": rotation.credential, "replay": rotation.replay}

    async def op_confirm_rotation(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        confirmation = self.ownership.confirm(args["rotation_id"])
        if confirmation.changed:
            cut = self._cut(confirmation.cut, f"rotation {confirmation.rotation_id} confirmed")
            log_event(
                "ownership_confirmed",
                f"credential rotation {confirmation.rotation_id} confirmed; the superseded credential is"
                f" refused from now on; closed {cut} connection(s) authenticated under it",
                ROTATION_ID=confirmation.rotation_id,
                CLOSED_CONNECTIONS=cut,
                PEER_PID=ctx.peer.pid,
            )
        return {"rotation_id": confirmation.rotation_id, "changed": confirmation.changed}

    async def op_claim(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self.ownership.claim(ctx.state.get("cred_id"))
        return {"unowned_period_s": self.unowned_period_s}

    async def op_ownership_shutdown(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_shutdown_fails")  # test fault, off unless $KANDEV_FAULT says so
        faults.hit("agentctl_lacks_shutdown")  # test fault: answers as a server without the op would
        # Already stopping (an unowned shutdown, an earlier call, a signal) counts as success (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7):
        # the reply still comes only once every instance is stopped.
        if self.ownership.begin_shutdown("ownership_shutdown"):
            self.exit_reason = self.exit_reason or "ownership_shutdown"
            log_event("agentctl_ownership_shutdown", "ownership_shutdown: stopping every instance, then exiting",
                      priority=5, PEER_PID=ctx.peer.pid)
        self._shutdown_calls += 1
        try:
            stopped = await self.stop_all()
        finally:
            self._shutdown_calls -= 1
        self._spawn_background(self._exit_after_reply(ctx, "ownership_shutdown"))
        return {"stopped": stopped}

    async def _exit_after_reply(self, ctx: ConnectionContext, reason: str) -> None:
        # Give the reply time to be written (or the client time to hang up) before closing.
        with contextlib.suppress(TimeoutError):
            await within(ctx.closed.wait(), _SHUTDOWN_REPLY_GRACE)
        self._request_exit(reason)

    # -- instances -----------------------------------------------------------

    async def op_create_instance(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self._refuse_if_shutting_down("create_instance")
        cwd = _check_str("cwd", args["cwd"])
        if not os.path.isabs(cwd) or not os.path.isdir(cwd):
            raise _bad(f"create_instance: cwd {cwd!r} is not an absolute path of an existing directory")
        resume = args.get("resume_session_id")
        spec = InstanceSpec(
            instance_id=uuid.uuid4().hex,
            session_id=_check_str("session_id", args["session_id"]),
            task_id=_check_str("task_id", args["task_id"]),
            command=_check_str_list("command", args["command"], allow_empty=False),
            cwd=cwd,
            env=_check_env(args.get("env", {})),
            agent=args.get("agent"),
            resume_session_id=_check_str("resume_session_id", resume) if resume is not None else None,
            workspace_roots=_check_str_list("workspace_roots", args.get("workspace_roots", []), allow_empty=True),
        )
        spec.secret_env = await self._agent_secrets(spec.agent, args.get("secret_env"))
        request = SandboxRequest.from_wire(args.get("sandbox"))
        if request.policy is SandboxPolicy.REQUIRED:
            request = agent_env.hide_secret_files(request, self.config.secret_refs(), args.get("secret_env"))
            launch = await self._sandboxed_argv(request, spec.command, cwd)
            spec.launch_argv, spec.launch_fds = launch.argv, list(launch.fds)
            spec.sandboxed = True
        else:
            log_event(
                "agent_unsandboxed",
                f"instance {spec.instance_id} of session {spec.session_id}: agent started WITHOUT a sandbox"
                " (agents.sandbox = \"off\"): it can reach everything this server's user can",
                priority=4,
                INSTANCE_ID=spec.instance_id,
                SESSION_ID=spec.session_id,
                TASK_ID=spec.task_id,
                AGENT=spec.agent,
            )
        kwargs: dict[str, Any] = {}
        if self._handshake_timeout is not None:
            kwargs["handshake_timeout"] = self._handshake_timeout
        inst = Instance(
            spec,
            agent_log_dir=Path(self.config.agent_log_dir),
            turn_ids=self.turn_ids,
            on_change=self._changed,
            detached_event_limit=self.detached_event_limit,  # per instance, by its own stream (AC-EXECUTORS-SURVIVAL-001.9)
            **kwargs,
        )
        self.instances[spec.instance_id] = inst
        self._changed()
        try:
            await inst.start()
        except BaseException as exc:
            await inst.stop()
            self.instances.pop(spec.instance_id, None)
            self._changed()
            if spec.sandboxed and isinstance(exc, IpcError) and "bwrap: " in inst.stderr_tail(1024):
                # bwrap's own error: a host that no longer admits the sandbox says so in its type
                support = await self.probe_sandbox()
                if not support.available:
                    raise sandbox.unavailable(support.reason or "unknown") from None
            raise
        if self.shutting_down:  # shut down while the agent was starting
            await inst.stop()
            self.instances.pop(spec.instance_id, None)
            raise IpcError(ErrorCode.SHUTTING_DOWN, "create_instance: the control server is shutting down")
        log_event(
            "instance_started",
            f"instance {spec.instance_id} started: agent {spec.agent or spec.command[0]} pid {inst.pid}"
            f" ({'sandboxed' if spec.sandboxed else 'NOT sandboxed'})",
            INSTANCE_ID=spec.instance_id,
            SESSION_ID=spec.session_id,
            TASK_ID=spec.task_id,
            PID=inst.pid,
            AGENT=spec.agent,
            SANDBOXED=int(spec.sandboxed),
        )
        return {
            "instance_id": spec.instance_id,
            "pid": inst.pid,
            "pid_start_time": inst.pid_start_time,
            "acp_session_id": inst.acp_session_id,
            "modes": inst.session_info.get("modes"),
            "config_options": list(inst.session_info.get("config_options") or []),
            "handshake_seq": inst.handshake_seq,
            "sandboxed": spec.sandboxed,
        }

    async def _agent_secrets(self, agent: Any, refs: Any) -> dict[str, str]:
        """The values of the agent's ``secret_env`` references, read off the loop (agent_env)."""
        try:
            parsed = agent_env.parse_refs(refs, f"agents.{agent or '?'}.secret_env")
        except SettingsError as exc:
            raise _bad(f"create_instance: secret_env: {exc}") from None
        if not parsed:
            return {}
        try:
            return await asyncio.to_thread(
                agent_env.resolve, parsed, f"agents.{agent or '?'}.secret_env",
                credentials_dir=os.environ.get("CREDENTIALS_DIRECTORY"), forbidden=self._own_paths())
        except agent_env.SecretUnavailable as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"create_instance: the agent's secret cannot be read: {exc}",
                           retryable=False) from None

    async def op_sandbox_status(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        support = self.sandbox_support
        if support is None or args.get("refresh"):
            support = await self.probe_sandbox()
        return support.to_wire()

    async def op_set_mode(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await self._get(args["instance_id"]).set_mode(_check_str("mode_id", args["mode_id"]))

    async def op_set_config_option(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        value = args["value"]
        if isinstance(value, str):
            value = _check_str("value", value)
        return await self._get(args["instance_id"]).set_config_option(
            _check_str("config_id", args["config_id"]), value
        )

    async def op_reset_context(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self._refuse_if_shutting_down("reset_context")
        inst = self._get(args["instance_id"])
        result = await inst.reset_context()
        log_event(
            "instance_context_reset",
            f"instance {inst.instance_id}: new ACP session {inst.acp_session_id} (context reset)",
            INSTANCE_ID=inst.instance_id,
            SESSION_ID=inst.spec.session_id,
            TASK_ID=inst.spec.task_id,
            PID=inst.pid,
        )
        return result

    async def op_prompt(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        inst = self._get(args["instance_id"])
        text = args["text"]
        if len(text) > _MAX_TEXT:
            raise _bad(f"prompt: text longer than {_MAX_TEXT} characters")
        return {"turn_id": inst.prompt(text)}

    async def op_cancel(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await self._get(args["instance_id"]).cancel()
        return {}

    async def op_respond_permission(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self._get(args["instance_id"]).respond_permission(args["request_id"], args.get("option_id"))
        return {}

    async def op_list_instances(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await faults.delay("agentctl_slow_enumeration")  # test fault, off unless $KANDEV_FAULT says so
        return {"instances": [inst.describe() for inst in self.instances.values()]}

    async def op_stop_instance(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_stop_fails")  # test fault, off unless $KANDEV_FAULT says so
        instance_id = args["instance_id"]
        inst = self.instances.get(instance_id)
        if inst is None:
            return {"stopped": False, "already_absent": True}
        await inst.stop()
        self.instances.pop(instance_id, None)
        self._changed()
        return {"stopped": True, "already_absent": False}

    async def op_attach(self, ctx: ConnectionContext, args: dict[str, Any]) -> None:
        inst = self._get(args["instance_id"])
        after_seq = args.get("after_seq", 0)
        sub = inst.attach(after_seq)
        log.debug("conn %d: attached to %s after seq %d", self._conn_id(ctx), inst.instance_id, after_seq)
        try:
            await ctx.start_stream(
                {
                    "instance_id": inst.instance_id,
                    "next_seq": inst.log.next_seq,
                    "retained_events": inst.log.retained_count,
                }
            )
            while True:
                event = await sub.next()
                if event is None:
                    break
                # What else is already retained goes in the same write (in order; a batch lost with
                # the connection is sent again from the backend's after_seq on its next attach).
                batch = [event, *sub.ready(STREAM_BATCH - 1)]
                await ctx.send_events([(e.seq, e.kind, e.data) for e in batch])
        except ConnectionClosed:
            pass
        finally:
            inst.detach(sub)
            log.debug("conn %d: detached from %s", self._conn_id(ctx), inst.instance_id)

    async def op_ack_events(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        discarded = self._get(args["instance_id"]).ack_events(args["seq"])
        return {"discarded": discarded}

    async def op_turn_status(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_turn_status_fails")  # test fault, off unless $KANDEV_FAULT says so
        return self._get(args["instance_id"]).turn_status()

    async def op_turn_statuses(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_turn_status_fails")  # the same test fault as one turn_status read
        await faults.delay("agentctl_slow_turn_statuses")  # answered as the instances are after the delay
        ids = args["instance_ids"]
        if len(ids) > TURN_STATUSES_MAX or not all(isinstance(i, str) for i in ids):
            raise IpcError(ErrorCode.INVALID_ARGUMENT,
                           f"instance_ids must be at most {TURN_STATUSES_MAX} instance ids (strings)")
        statuses: dict[str, Any] = {}
        missing: list[str] = []
        for instance_id in ids:
            inst = self.instances.get(instance_id)
            if inst is None or inst.gone:
                missing.append(instance_id)
            else:
                statuses[instance_id] = inst.turn_status()
        return {"statuses": statuses, "missing": missing}

    async def op_ack_turn(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        turn_id = args["turn_id"]
        for inst in self.instances.values():
            if inst.ack_turn(turn_id):
                return {"acked": True}
        return {"acked": False}  # unknown id: accepted, nothing changes (AC-EXECUTORS-SURVIVAL-004.6)
