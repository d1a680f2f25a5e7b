"""The control server's operations over ``ipc.server.IpcServer`` with ``protocol.TABLE``.

Ownership (design.md §5; rotation and the unowned timer are a later issue):

- ``identify`` (unauthenticated) returns the per-launch ``server_identity``,
  the capability set, the protocol version and the unowned period, and no
  path of any kind (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11).
- ``prove`` answers the backend's fresh 32-byte challenge with
  ``auth.server_proof`` for each acceptable credential (001.10).
- ``auth_begin`` / ``auth_finish`` authenticate one connection with an HMAC
  over a fresh server nonce; a failed ``auth_finish`` consumes the nonce. Every
  op declared ``auth=True`` is refused with ``unauthenticated`` on a
  connection that has not finished this.
- ``claim`` records the renewal on the server's monotonic clock.

Instances (design.md §6): see ``daemon.agentctl.instance``. Unknown instance
ids are ``not_found``, except for ``stop_instance``, where an absent instance
counts as stopped (``already_absent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.agentctl import auth
from daemon.agentctl.instance import Instance, InstanceSpec, TurnIds
from daemon.agentctl.launch import LaunchConfig
from daemon.agentctl.protocol import TABLE
from daemon.config import ResolvedAgentctl
from daemon.journal import log_event
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.framing import ConnectionClosed
from ipc.schema import Op
from ipc.server import IpcServer

log = logging.getLogger("kandev.agentctl.server")

_SHUTDOWN_REPLY_GRACE = 0.5  # seconds the ownership_shutdown reply gets before the process exits
_MAX_TEXT = 4 * 1024 * 1024


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
        # Acceptable credentials, newest first (at most two once rotation exists).
        self._credentials: list[bytes] = [credential]
        # A spawn without a handshake counts from process start (OWN-003.8).
        self.last_renewal = time.monotonic()
        self.shutting_down = False
        self.exit_requested = asyncio.Event()
        self.instances: dict[str, Instance] = {}
        self.turn_ids = TurnIds(self.server_identity)
        self._on_instances_changed = on_instances_changed
        self._handshake_timeout = handshake_timeout
        self._conn_counter = 0
        self._background: set[asyncio.Task[Any]] = set()
        handlers = {name: self._logged(name, getattr(self, f"op_{name}")) for name in TABLE.names}
        self.ipc = IpcServer(config.socket_path, TABLE, handlers, authorize=self._authorize)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        await self.ipc.start()

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
        """Stop everything and close the socket (SIGTERM/SIGINT and after ownership_shutdown)."""
        self.shutting_down = True
        stopped = await self.stop_all()
        await self.ipc.close()
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
        if ctx.state.get("authenticated") is True:
            return
        log.debug("conn %d (pid %d) op %s refused: unauthenticated", self._conn_id(ctx), ctx.peer.pid, op.name)
        raise IpcError(
            ErrorCode.UNAUTHENTICATED,
            f"{op.name} needs an authenticated connection (prove, then auth_begin and auth_finish)",
        )

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
            "capabilities": list(TABLE.capabilities),
            "protocol_version": list(TABLE.version),
            "unowned_period_s": self.unowned_period_s,
        }

    async def op_prove(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        challenge = args["challenge"]
        if len(challenge) != auth.CHALLENGE_BYTES:
            raise _bad(f"prove: the challenge must be {auth.CHALLENGE_BYTES} bytes, not {len(challenge)}")
        proofs = [
            auth.server_proof(cred, challenge, self.server_identity, self.installation_id)
            for cred in self._credentials
        ]
        return {"proofs": proofs}

    async def op_auth_begin(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        nonce = auth.new_challenge()
        ctx.state["nonce"] = nonce
        return {"nonce": nonce}

    async def op_auth_finish(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        nonce = ctx.state.pop("nonce", None)  # one attempt per nonce
        if nonce is None:
            raise IpcError(ErrorCode.UNAUTHENTICATED, "auth_finish without a pending auth_begin nonce")
        matched = False
        for cred in self._credentials:
            matched |= auth.verify(auth.connection_proof(cred, nonce, self.server_identity), args["proof"])
        if not matched:
            log_event(
                "agentctl_auth_failed",
                f"a connection from pid {ctx.peer.pid} failed authentication",
                priority=4,
                PEER_PID=ctx.peer.pid,
                PEER_UID=ctx.peer.uid,
            )
            raise IpcError(ErrorCode.UNAUTHENTICATED, "authentication failed")
        ctx.state["authenticated"] = True
        return {}

    async def op_claim(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        self._refuse_if_shutting_down("claim")
        self.last_renewal = time.monotonic()
        return {"unowned_period_s": self.unowned_period_s}

    async def op_ownership_shutdown(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        already = self.shutting_down
        self.shutting_down = True
        if not already:
            log_event("agentctl_ownership_shutdown", "ownership_shutdown: stopping every instance, then exiting",
                      priority=5, PEER_PID=ctx.peer.pid)
        stopped = await self.stop_all()
        self._spawn_background(self._exit_after_reply(ctx))
        return {"stopped": stopped}

    async def _exit_after_reply(self, ctx: ConnectionContext) -> None:
        # Give the reply time to be written (or the client time to hang up) before closing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ctx.closed.wait(), _SHUTDOWN_REPLY_GRACE)
        self.exit_requested.set()

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
        kwargs: dict[str, Any] = {}
        if self._handshake_timeout is not None:
            kwargs["handshake_timeout"] = self._handshake_timeout
        inst = Instance(
            spec,
            agent_log_dir=Path(self.config.agent_log_dir),
            turn_ids=self.turn_ids,
            on_change=self._changed,
            **kwargs,
        )
        self.instances[spec.instance_id] = inst
        self._changed()
        try:
            await inst.start()
        except BaseException:
            await inst.stop()
            self.instances.pop(spec.instance_id, None)
            self._changed()
            raise
        if self.shutting_down:  # shut down while the agent was starting
            await inst.stop()
            self.instances.pop(spec.instance_id, None)
            raise IpcError(ErrorCode.SHUTTING_DOWN, "create_instance: the control server is shutting down")
        log_event(
            "instance_started",
            f"instance {spec.instance_id} started: agent {spec.agent or spec.command[0]} pid {inst.pid}",
            INSTANCE_ID=spec.instance_id,
            SESSION_ID=spec.session_id,
            TASK_ID=spec.task_id,
            PID=inst.pid,
            AGENT=spec.agent,
        )
        return {
            "instance_id": spec.instance_id,
            "pid": inst.pid,
            "pid_start_time": inst.pid_start_time,
            "acp_session_id": inst.acp_session_id,
        }

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
        return {"instances": [inst.describe() for inst in self.instances.values()]}

    async def op_stop_instance(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
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
                await ctx.send_event(event.seq, event.kind, event.data)
        except ConnectionClosed:
            pass
        finally:
            inst.detach(sub)
            log.debug("conn %d: detached from %s", self._conn_id(ctx), inst.instance_id)

    async def op_ack_events(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        discarded = self._get(args["instance_id"]).ack_events(args["seq"])
        return {"discarded": discarded}

    async def op_turn_status(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return self._get(args["instance_id"]).turn_status()

    async def op_ack_turn(self, ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        turn_id = args["turn_id"]
        for inst in self.instances.values():
            if inst.ack_turn(turn_id):
                return {"acked": True}
        return {"acked": False}  # unknown id: accepted, nothing changes (AC-EXECUTORS-SURVIVAL-004.6)
