"""The backend's client of ``kandev-agentctl``.

``AgentctlClient.connect`` runs the ownership handshake of docs/architecture.md#ownership
(``daemon.agentctl.client.handshake``) on a fresh connection, in this order, and sends nothing else
before it succeeds:

1. ``identify`` (unauthenticated). An error answer, no identity or no
   capability set (unreadable), or an identity other than
   ``expected_identity`` -> ``OwnershipRefused("identity_mismatch")``.
2. ``prove`` with a fresh 32-byte challenge; the server's answer is checked in
   constant time against ``auth.server_proof`` **before anything else is
   sent**; no match -> ``OwnershipRefused("authentication_failure")``
   (AC-EXECUTORS-CONTROL-OWNERSHIP-001.10).
3. ``auth_begin`` / ``auth_finish``: the connection is authenticated with an
   HMAC over the server's nonce; the credential itself never crosses the socket.

Every ``attach`` opens a new connection, runs the same handshake on it and
dedicates it to that instance's event stream. ``attach_shared`` reads the same stream, but the
attaches asked in one moment share one such connection (``attach_many``, on a server with
``attach_many.v1``; ``daemon.agentctl.client.shared_streams``).

Rotation (REQ-EXECUTORS-CONTROL-OWNERSHIP-002; the server side is
``daemon.agentctl.ownership``). The server accepts at most two credentials:
the current one (everything) and, while the highest rotation is unconfirmed,
the one it superseded (only ``rotate`` and ``ownership_shutdown``). So an
adopting backend, whose stored credential may be either, connects with
``purpose="adopt"``; ``purpose="drive"`` (the default) refuses a connection
that authenticated only with a superseded credential. Adoption::

    client = await AgentctlClient.connect(path, credential=stored, installation_id=...,
                                          expected_identity=recorded, purpose="adopt")
    # capabilities: compare client.capabilities with the required set locally
    rotation_id, new_credential = await client.rotate()      # renews; start the claim loop now
    # persist new_credential (secret file) and the record's reference, both durably
    await client.reauthenticate(new_credential)              # or a fresh connect() with it
    await client.confirm_rotation(rotation_id)               # the old credential is now refused
    # claim every period/4 (strictly less than period/3) with the new credential

A rotate retried with the same stored credential while unconfirmed returns
the same pair (AC-EXECUTORS-CONTROL-OWNERSHIP-002.10). After the confirmation
every connection and stream authenticated under the old credential is closed
by the server.

``daemon.agentctl.client.handshake.identify(socket_path)`` is the standalone, unauthenticated
probe: None when nothing answers (no socket, connection refused, timeout).

Reconnection (Issue 15). The server closes every connection when it
re-executes (``reload``): a request it refused with ``reloading``, or that was
pending when the connection ended with a last ``reloading`` frame, never ran.
``call`` then connects again (the same handshake: same identity, this client's
credential) and sends it again, patiently, for up to ``RELOAD_WINDOW_S``, since
the new process image takes a moment to serve. A connection found closed for
any other reason is re-established once before a call (patiently too if a
server said ``reloading`` within ``RELOAD_WINDOW_S``: ``reload_seen_recently``);
if that fails, the call fails as before.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, cast

from daemon.agentctl import auth
from daemon.agentctl.client.handshake import (
    RELOAD_WINDOW_S,
    authenticate,
    handshake,
    reload_seen_recently,
    saw_reload,
)
from daemon.agentctl.client.replies import (
    CreatedInstance,
    InstanceEntry,
    NewProviderSession,
    ReloadStarted,
    ServerInfo,
    StopResult,
    TurnStatus,
)
from daemon.agentctl.client.shared_streams import InstanceStream, SharedAttacher
from daemon.agentctl.protocol import (
    AGENT_LIMITS_CAPABILITY,
    AGENT_MEMORY_CAPABILITY,
    AGENT_SECRETS_CAPABILITY,
    ATTACH_MANY_CAPABILITY,
    NETWORK_CAPABILITY,
    RELOAD_CAPABILITY,
    SANDBOX_CAPABILITY,
)
from daemon.agentctl.sandbox.bubblewrap import SANDBOX_UNAVAILABLE, SandboxPolicy
from ipc.client import AsyncClient, EventStream
from ipc.errors import ErrorCode, IpcError

__all__ = ["ADOPT", "DRIVE", "AgentctlClient"]

DRIVE = "drive"
"""Connect purpose: the credential must be the current one (instance operations, streams, claim)."""
ADOPT = "adopt"
"""Connect purpose: the credential may be the superseded one (only rotate and ownership_shutdown work then)."""

CREATE_TIMEOUT = 150.0
"""Seconds ``create_instance`` may take (spawn, then initialize and session/new|load, 60 s each at
most: ``daemon.agentctl.instance.instance.HANDSHAKE_TIMEOUT``)."""
STOP_TIMEOUT = 30.0
"""Seconds ``stop_instance`` may take (SIGTERM, 3 s grace, SIGKILL, reaping)."""
SHUTDOWN_TIMEOUT = 60.0
"""Seconds ``ownership_shutdown`` may take (every instance stopped in parallel)."""
_RETRY_PAUSE_S = 0.05


def _cut_by_reload(exc: IpcError, conn: AsyncClient) -> bool:
    """Whether a call failed because the server re-executes, so it never ran: refused with
    ``reloading``, or sent on a connection the server had just closed to re-execute (the close
    reached us after the call left: it fails ``unavailable``, the connection's cause ``reloading``).
    The server refuses new requests before it closes its connections, so neither ran."""
    if exc.code == ErrorCode.RELOADING:
        return True
    cause = conn.closed_by
    return exc.code == ErrorCode.UNAVAILABLE and cause is not None and cause.code == ErrorCode.RELOADING


class AgentctlClient:
    """An authenticated connection to one control server. Build it with ``await connect(...)``."""

    def __init__(
        self,
        socket_path: str,
        conn: AsyncClient,
        info: dict[str, Any],
        *,
        credential: bytes,
        installation_id: str,
        timeout: float,
        purpose: str = DRIVE,
    ) -> None:
        self.socket_path = socket_path
        self.purpose = purpose
        self.identity: str = info["server_identity"]
        self.capabilities: frozenset[str] = frozenset(info["capabilities"])
        self.protocol_version: tuple[int, ...] = tuple(info.get("protocol_version") or ())
        self.unowned_period_s: float | None = info.get("unowned_period_s")
        self.credential_role: str | None = info.get("credential_role")
        """``current`` or ``superseded``: which accepted credential authenticated this connection."""
        self.timeout = timeout
        self.on_superseded: Callable[[AgentctlClient], None] | None = None
        """Called (once per refusal) when an operation is refused with ``superseded_credential``:
        another holder of the installation's credential adopted the server (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3)."""
        self._conn = conn
        self._credential = credential
        self._installation_id = installation_id
        self._closed_by_us = False
        self._reconnect_lock = asyncio.Lock()
        self._shared = SharedAttacher(self._open_attach_many, self._detach_stream)

    @classmethod
    async def connect(
        cls,
        socket_path: str | os.PathLike[str],
        *,
        credential: bytes,
        installation_id: str,
        expected_identity: str | None = None,
        timeout: float = 5.0,
        purpose: str = DRIVE,
    ) -> AgentctlClient:
        """Connect, check identity and the server's proof, authenticate (see the module doc).

        ``purpose="drive"``: a credential the server accepts only as superseded is refused here
        with ``IpcError(superseded_credential)``. ``purpose="adopt"``: it is accepted, and the
        connection can then only ``rotate`` and ``ownership_shutdown``.

        Raises ``OwnershipRefused`` (``.reason``) or ``IpcError`` (e.g. ``unavailable``).
        """
        if purpose not in (DRIVE, ADOPT):
            raise ValueError(f"purpose must be {DRIVE!r} or {ADOPT!r}, not {purpose!r}")
        path = os.fspath(socket_path)
        conn = await AsyncClient.connect(path, timeout=timeout, hello=False)
        try:
            info = await handshake(
                conn,
                credential=credential,
                installation_id=installation_id,
                expected_identity=expected_identity,
                timeout=timeout,
            )
            if purpose == DRIVE and info.get("credential_role") == "superseded":
                raise IpcError(
                    ErrorCode.SUPERSEDED_CREDENTIAL,
                    "the credential was superseded by a rotation: it may only rotate (adopt) or shut the"
                    " server down",
                )
        except BaseException:
            await conn.close()
            raise
        return cls(path, conn, info, credential=credential, installation_id=installation_id, timeout=timeout,
                   purpose=purpose)

    async def close(self) -> None:
        self._closed_by_us = True
        await self._shared.close()
        await self._conn.close()

    async def __aenter__(self) -> AgentctlClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def usable(self) -> bool:
        """Whether calls may go through: until ``close()``. A connection the server closed (a
        re-exec) is re-established by the next call, so ``closed`` alone does not mean unusable."""
        return not self._closed_by_us

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Any op of ``protocol.TABLE`` on the authenticated connection (re-established if the
        server re-executed: see the module doc)."""
        loop = asyncio.get_running_loop()
        reload_deadline: float | None = None  # set once the server said it is re-executing
        while True:
            conn = self._conn
            try:
                if conn.closed and not self._closed_by_us:
                    conn = await self._reconnect(reload_deadline)
                return await conn.call(op, args, timeout=self.timeout if timeout is None else timeout)
            except IpcError as exc:
                if exc.code == ErrorCode.SUPERSEDED_CREDENTIAL and self.on_superseded is not None:
                    self.on_superseded(self)
                if not _cut_by_reload(exc, conn):
                    raise
                saw_reload()
                if reload_deadline is None:
                    reload_deadline = loop.time() + RELOAD_WINDOW_S
                elif loop.time() >= reload_deadline:
                    raise
                await conn.close()  # the server closes it anyway: send it again on a new one
                await asyncio.sleep(_RETRY_PAUSE_S)  # it never ran

    async def _map(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None
                   ) -> dict[str, Any]:
        """``call`` of an op whose result is a map."""
        result: dict[str, Any] = await self.call(op, args, timeout=timeout)
        return result

    async def _reconnect(self, patient_until: float | None) -> AsyncClient:
        """The connection, re-established if it is closed (one reconnection at a time: concurrent
        callers share it): same server (identity checked), this client's credential; retried until
        ``patient_until`` (loop time) while nothing answers yet."""
        async with self._reconnect_lock:
            if not self._conn.closed or self._closed_by_us:
                return self._conn  # another caller reconnected meanwhile (or we were closed)
            await self._reconnect_locked(patient_until)
            return self._conn

    async def _reconnect_locked(self, patient_until: float | None) -> None:
        loop = asyncio.get_running_loop()
        cause = self._conn.closed_by
        if cause is not None and cause.code == ErrorCode.RELOADING:
            saw_reload()  # the server closed this connection to re-execute
        await self._conn.close()  # its reader task ends here, not in the garbage collector
        if patient_until is None and reload_seen_recently():
            patient_until = loop.time() + RELOAD_WINDOW_S
        while True:
            try:
                conn = await AsyncClient.connect(self.socket_path, timeout=self.timeout, hello=False)
                try:
                    info = await handshake(conn, credential=self._credential, installation_id=self._installation_id,
                                            expected_identity=self.identity, timeout=self.timeout)
                except BaseException:
                    await conn.close()
                    raise
            except IpcError as exc:
                retry = exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.RELOADING)
                if not retry or patient_until is None or loop.time() >= patient_until:
                    raise
                await asyncio.sleep(_RETRY_PAUSE_S * 2)
                continue
            role = info.get("credential_role")
            if role == "superseded" and self.purpose == DRIVE:
                await conn.close()
                raise IpcError(ErrorCode.SUPERSEDED_CREDENTIAL, "the credential was superseded by a rotation")
            self._conn = conn
            self.credential_role = role
            self.capabilities = frozenset(info["capabilities"])
            self.protocol_version = tuple(info.get("protocol_version") or ())
            return

    # -- ownership ----------------------------------------------------------

    async def claim(self) -> dict[str, Any]:
        """Renew ownership (current credential) -> ``{unowned_period_s}``."""
        return await self._map("claim")

    async def rotate(self, *, timeout: float | None = None) -> tuple[int, bytes]:
        """Replace the credential, presenting this connection's -> ``(rotation_id, new_credential)``.

        Renews ownership. Retried with the same (superseded) credential before the confirmation,
        it returns the same pair. Refused with ``shutting_down`` once the server decided to exit.
        The connection itself stays authenticated under the old credential: ``reauthenticate``
        (or connect again) with the new one, after storing it durably, to confirm and go on.
        """
        result = await self.call("rotate", timeout=timeout)
        rotation_id = result.get("rotation_id") if isinstance(result, dict) else None
        credential = result.get("credential") if isinstance(result, dict) else None
        if (
            not isinstance(rotation_id, int)
            or isinstance(rotation_id, bool)
            or not isinstance(credential, bytes)
            or len(credential) != auth.CREDENTIAL_BYTES
        ):
            raise IpcError(ErrorCode.INVALID_FRAME, "rotate: malformed answer from the control server")
        return rotation_id, credential

    async def reauthenticate(self, credential: bytes) -> str | None:
        """Authenticate this connection again, with ``credential`` (e.g. the one ``rotate`` returned).

        On success later ``attach`` connections use it too; returns the slot it filled. A refusal
        raises ``OwnershipRefused(authentication_failure)`` and leaves the connection unauthenticated.
        """
        role = await authenticate(self._conn, credential=credential, identity=self.identity, timeout=self.timeout)
        self._credential = credential
        self.credential_role = role
        return role

    async def confirm_rotation(self, rotation_id: int, *, timeout: float | None = None) -> dict[str, Any]:
        """The replacement of ``rotation_id`` is durably stored (connection authenticated with it)
        -> ``{rotation_id, changed}``. Earlier or repeated ids are accepted no-ops; an id never
        issued is refused with ``unknown_rotation``."""
        return await self._map("confirm_rotation", {"rotation_id": rotation_id}, timeout=timeout)

    async def ownership_shutdown(self, *, timeout: float = SHUTDOWN_TIMEOUT) -> dict[str, Any]:
        """Stop every instance; the server then exits -> ``{stopped: [instance_id]}``.

        Works with the superseded credential too (``purpose="adopt"``) and succeeds again while the
        server is already stopping."""
        return await self._map("ownership_shutdown", timeout=timeout)

    # -- instances ----------------------------------------------------------

    async def create_instance(
        self,
        *,
        session_id: str,
        task_id: str,
        command: list[str],
        cwd: str,
        env: dict[str, str] | None = None,
        agent: str | None = None,
        resume_session_id: str | None = None,
        workspace_roots: list[str] | None = None,
        sandbox: dict[str, Any] | None = None,
        secret_env: dict[str, str] | None = None,
        max_memory: int | None = None,
        network: dict[str, Any] | None = None,
        timeout: float = CREATE_TIMEOUT,
    ) -> CreatedInstance:
        """Spawn an agent -> ``{instance_id, pid, pid_start_time, pid_start_stamp, acp_session_id, modes,
        config_options, handshake_seq, sandboxed}`` (the last four from servers that know them). ``sandbox``: the
        wire form of ``daemon.agentctl.sandbox.bubblewrap.SandboxRequest``; ``secret_env``: the agent's secrets by
        reference (``daemon.agents.settings``), read by the server; ``max_memory``: the agent's memory
        bound in bytes (sent to a server with ``agent_memory.v1`` only)."""
        args: dict[str, Any] = {"session_id": session_id, "task_id": task_id, "command": command, "cwd": cwd}
        if env is not None:
            args["env"] = env
        if agent is not None:
            args["agent"] = agent
        if resume_session_id is not None:
            args["resume_session_id"] = resume_session_id
        if workspace_roots is not None:
            args["workspace_roots"] = workspace_roots
        if sandbox is not None and self.check_sandbox(sandbox):
            if AGENT_LIMITS_CAPABILITY not in self.capabilities:  # an older server refuses the field
                sandbox = {k: v for k, v in sandbox.items() if k != "max_processes"}
            args["sandbox"] = sandbox
        if max_memory is not None and AGENT_MEMORY_CAPABILITY in self.capabilities:
            args["max_memory"] = max_memory  # bytes; an older server has no memory bound to apply
        if secret_env:  # references only ({VAR: path | credential:NAME}); never sent to a server without them
            self.check_secret_env(secret_env)
            args["secret_env"] = secret_env
        if network is not None:  # the agent's network policy; never sent to a server without network.v1
            self.check_network(network)
            args["network"] = network
        return cast(CreatedInstance, await self.call("create_instance", args, timeout=timeout))

    def check_sandbox(self, sandbox: dict[str, Any]) -> bool:
        """Whether this server takes ``create_instance``'s ``sandbox`` field. A server without
        ``sandbox.v1`` (release 0.1.0) would drop it and start the agent unsandboxed: with the
        policy ``required`` that launch is refused here (``sandbox_unavailable``, nothing sent);
        with ``off`` the field is left out (False)."""
        if SANDBOX_CAPABILITY in self.capabilities:
            return True
        if sandbox.get("policy", SandboxPolicy.REQUIRED.value) == SandboxPolicy.OFF.value:
            return False
        protocol = ".".join(map(str, self.protocol_version)) or "1.0"
        raise IpcError(
            SANDBOX_UNAVAILABLE,
            f"the control server (protocol {protocol}) predates the agent sandbox: it would start this agent"
            ' unsandboxed, which agents.sandbox = "required" refuses. The backend replaces it with the'
            " installed version once it runs no instance (end or stop its sessions, then start again);"
            ' or set agents.sandbox = "off"',
            retryable=True,
        )

    def _older_server(self) -> tuple[str, str]:
        """This server's protocol version as text, and how to get one of the installed version."""
        protocol = ".".join(map(str, self.protocol_version)) or "1.0"
        how = ("reload it with the installed version: kandev agentctl reload" if RELOAD_CAPABILITY in self.capabilities
               else "the backend replaces it with the installed version once it runs no instance (end or stop its"
               " sessions, then start again)")
        return protocol, how

    def check_secret_env(self, secret_env: dict[str, str] | None) -> None:
        """Refuse (``incompatible_version``, nothing sent) a launch that gives the agent keys
        (``secret_env``) to a server without ``agent_secrets.v1``: it would drop the field and start
        the agent without them. No keys: nothing to check, any server will do."""
        if not secret_env or AGENT_SECRETS_CAPABILITY in self.capabilities:
            return
        protocol, how = self._older_server()
        raise IpcError(
            ErrorCode.INCOMPATIBLE_VERSION,
            f"the control server (protocol {protocol}) predates agents' keys: it would start this agent without"
            f" its secret_env ({', '.join(sorted(secret_env))}); {how}",
            retryable=True,
        )

    def check_network(self, network: dict[str, Any] | None) -> None:
        """Refuse (``sandbox_unavailable``, nothing sent) a sandboxed launch on a server without
        ``network.v1``: it would start the agent on the host's network, which every agent's own
        network namespace forbids (Issue 44)."""
        if network is None or NETWORK_CAPABILITY in self.capabilities:
            return
        protocol, how = self._older_server()
        raise IpcError(
            SANDBOX_UNAVAILABLE,
            f"the control server (protocol {protocol}) predates agents' own network namespaces: it would start this"
            f" agent on the host's network; {how}",
            retryable=True,
        )

    async def sandbox_status(self, *, refresh: bool = False) -> dict[str, Any]:
        """Whether the server can sandbox agents -> ``{available, reason, mechanism, bwrap, version}``;
        a server older than the sandbox answers ``unknown_op``."""
        return await self._map("sandbox_status", {"refresh": refresh} if refresh else {}, timeout=CREATE_TIMEOUT)

    async def set_mode(self, instance_id: str, mode_id: str) -> dict[str, Any]:
        """ACP session/set_mode -> ``{acp_session_id, mode_id, last_seq}`` (refused: agent_error)."""
        return await self._map("set_mode", {"instance_id": instance_id, "mode_id": mode_id}, timeout=CREATE_TIMEOUT)

    async def set_config_option(self, instance_id: str, config_id: str, value: str | bool) -> dict[str, Any]:
        """ACP session/set_config_option -> ``{acp_session_id, config_options, last_seq}``."""
        return await self._map(
            "set_config_option",
            {"instance_id": instance_id, "config_id": config_id, "value": value},
            timeout=CREATE_TIMEOUT,
        )

    async def reset_context(self, instance_id: str) -> NewProviderSession:
        """A new ACP session on the same process -> ``{acp_session_id, modes, config_options, last_seq}``."""
        return cast(NewProviderSession, await self.call("reset_context", {"instance_id": instance_id}, timeout=CREATE_TIMEOUT))

    async def prompt(self, instance_id: str, text: str) -> str:
        """Open a turn -> its server-assigned turn id."""
        result = await self.call("prompt", {"instance_id": instance_id, "text": text})
        turn_id: str = result["turn_id"]
        return turn_id

    async def cancel(self, instance_id: str) -> None:
        await self.call("cancel", {"instance_id": instance_id})

    async def respond_permission(self, instance_id: str, request_id: str, option_id: str | None) -> None:
        """Answer a permission request; ``option_id`` None answers ``cancelled``."""
        args: dict[str, Any] = {"instance_id": instance_id, "request_id": request_id}
        if option_id is not None:
            args["option_id"] = option_id
        await self.call("respond_permission", args)

    async def list_instances(self) -> list[InstanceEntry]:
        """Every instance with the session and task ids the server holds (AC-EXECUTORS-SURVIVAL-002.1)."""
        result = await self.call("list_instances")
        return list(result["instances"])

    async def stop_instance(self, instance_id: str, *, timeout: float = STOP_TIMEOUT) -> StopResult:
        """Kill the instance's group -> ``{stopped, already_absent}`` (absent counts as success)."""
        return cast(StopResult, await self.call("stop_instance", {"instance_id": instance_id}, timeout=timeout))

    async def ack_events(self, instance_id: str, seq: int) -> dict[str, Any]:
        """Every event <= ``seq`` is durably applied; the server may drop them -> ``{discarded}``."""
        return await self._map("ack_events", {"instance_id": instance_id, "seq": seq})

    async def turn_status(self, instance_id: str) -> TurnStatus:
        """Pure read -> ``{current_turn_id, outcomes: [{turn_id, stop_reason, error}]}``."""
        return cast(TurnStatus, await self.call("turn_status", {"instance_id": instance_id}))

    @property
    def supports_turn_statuses(self) -> bool:
        """Whether the server speaks protocol 1.2 (``turn_statuses``); 1.1 (release 0.2.0) does not."""
        return self.protocol_version[:2] >= (1, 2)

    async def turn_statuses(self, instance_ids: list[str]) -> dict[str, Any]:
        """Protocol 1.2: ``turn_status`` of many instances in one pure read -> ``{statuses:
        {instance_id: TurnStatus}, missing: [instance_id]}``; ``unknown_op`` from 1.1."""
        return await self._map("turn_statuses", {"instance_ids": instance_ids})

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """Protocol 1.1 (``reload.v1``): ``{version, pid, reload: {...}}``; ``unknown_op`` from 1.0."""
        return cast(ServerInfo, await self.call("server_info", timeout=timeout))

    async def reload(self) -> ReloadStarted:
        """Start (or join) a re-exec of the installed code -> ``{attempt, version, pid}``; follow
        ``server_info()['reload']`` for its outcome."""
        return cast(ReloadStarted, await self.call("reload"))

    async def ack_turn(self, turn_id: str) -> dict[str, Any]:
        """Drop a retained outcome; an unknown id is accepted and changes nothing -> ``{acked}``."""
        return await self._map("ack_turn", {"turn_id": turn_id})

    async def attach(self, instance_id: str, after_seq: int = 0, *, batched: bool = True) -> EventStream:
        """Open the instance's event stream on a new authenticated connection.

        Events <= ``after_seq`` are discarded by the server; the stream then
        yields ``Event(seq, kind, data)`` in order, retained ones first. Its
        ``result`` is ``{instance_id, next_seq, retained_events}``. A newer
        ``attach`` of the same instance ends this one. ``batched``: the server puts the events of
        one write in one frame (an older server ignores it; ``False`` asks what a 0.2.0 backend asked).
        """
        # batched: ignored by an older server (one frame per event)
        return await self._open_stream("attach", {"instance_id": instance_id, "after_seq": after_seq,
                                                  "batched": batched})

    async def attach_shared(self, instance_id: str, after_seq: int = 0) -> EventStream | InstanceStream:
        """The instance's event stream, as ``attach`` opens it, on a connection shared with the
        other attaches asked in the same moment (one ``attach_many``); on a server without
        ``attach_many.v1``, ``attach`` itself. Either answer has ``batch``, ``close`` and ``result``;
        an ``InstanceStream`` also ``detach`` (ending the server's stream of it alone)."""
        if ATTACH_MANY_CAPABILITY not in self.capabilities:
            return await self.attach(instance_id, after_seq)
        return await self._shared.attach(instance_id, after_seq)

    async def _open_attach_many(self, instances: list[list[Any]]) -> EventStream:
        return await self._open_stream("attach_many", {"instances": instances})

    async def _detach_stream(self, instance_id: str, token: str) -> Any:
        return await self.call("detach", {"instance_id": instance_id, "stream": token})

    async def _open_stream(self, op: str, args: dict[str, Any]) -> EventStream:
        """A stream op on a new connection that ran the handshake (the stream owns the connection)."""
        conn = await AsyncClient.connect(self.socket_path, timeout=self.timeout, hello=False)
        try:
            await handshake(
                conn,
                credential=self._credential,
                installation_id=self._installation_id,
                expected_identity=self.identity,
                timeout=self.timeout,
            )
            return await conn.stream(op, args, timeout=self.timeout)
        except BaseException:
            await conn.close()
            raise
