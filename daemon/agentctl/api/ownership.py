"""The ownership ops (docs/architecture.md#ownership): thin handlers over ``Ownership`` and
``ConnectionAuth``.

- ``identify`` (unauthenticated) returns the per-launch ``server_identity``, the capability set,
  the protocol version and the unowned period, and no path of any kind
  (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11).
- ``prove`` answers the backend's fresh 32-byte challenge with ``auth.server_proof`` for each
  acceptable credential (AC-EXECUTORS-CONTROL-OWNERSHIP-001.10).
- ``auth_begin`` / ``auth_finish`` authenticate one connection with an HMAC over a fresh server
  nonce (``ConnectionAuth.authenticate``).
- ``rotate`` / ``confirm_rotation``: the two-phase switch. When a credential stops authenticating
  anything (a confirmation, or a rotation past an unconfirmed one) every connection and stream
  authenticated under it is aborted at once (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2).
- ``claim``, a rotation (replay included) and the bootstrap (the first authentication with the
  launch credential) renew ownership; nothing else does (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8).
- ``ownership_shutdown`` stops every instance, answers, then asks the process to exit; already
  stopping counts as success (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from daemon.agentctl import auth
from daemon.agentctl.connection_auth import ConnectionAuth
from daemon.agentctl.instances import InstanceService
from daemon.agentctl.protocol import TABLE
from daemon.agentctl.server_context import ServerContext
from daemon.core import faults
from daemon.core.journal import log_event
from ipc.aio import within
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.server import Handler

log = logging.getLogger("kandev.agentctl.server")

SHUTDOWN_REPLY_GRACE = 0.5
"""Seconds the ownership_shutdown reply gets before the process exits."""


def handlers(server: ServerContext, conn_auth: ConnectionAuth, instances: InstanceService) -> dict[str, Handler]:
    """The ownership ops' handlers."""

    def identify(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "server_identity": server.server_identity,
            "capabilities": [c for c in TABLE.capabilities
                             if not (c == "turns.v1" and faults.active("agentctl_lacks_turns"))],
            "protocol_version": list(TABLE.version),
            "unowned_period_s": server.unowned_period_s,
        }

    def prove(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        challenge = args["challenge"]
        if len(challenge) != auth.CHALLENGE_BYTES:
            raise IpcError(ErrorCode.INVALID_ARGUMENT,
                           f"prove: the challenge must be {auth.CHALLENGE_BYTES} bytes, not {len(challenge)}")
        return {"proofs": server.ownership.prove(challenge, server.server_identity, server.installation_id)}

    def auth_begin(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        nonce = auth.new_challenge()
        ctx.state["nonce"] = nonce
        return {"nonce": nonce}

    def auth_finish(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        cred_id = conn_auth.authenticate(ctx, args["proof"], "auth_finish")
        role = server.ownership.role(cred_id)
        if server.ownership.bootstrap(cred_id):
            log.info("conn %d: bootstrap handshake with the launch credential (ownership renewed)",
                     server.conn_id(ctx))
        log.debug("conn %d: authenticated (%s credential)", server.conn_id(ctx), role)
        return {"credential": role}

    async def rotate(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await faults.delay("agentctl_slow_rotate")  # test fault, off unless $KANDEV_FAULT says so
        if "proof" in args:
            conn_auth.authenticate(ctx, args["proof"], "rotate")
        elif ctx.state.get("authenticated") is not True:
            raise IpcError(ErrorCode.UNAUTHENTICATED, "rotate needs an authenticated connection or a proof")
        faults.hit("agentctl_rotate_fails")  # test fault, off unless $KANDEV_FAULT says so
        rotation = server.ownership.rotate_as(ctx.state.get("cred_id"))
        cut = conn_auth.cut(rotation.cut, f"rotation {rotation.rotation_id} left its credential no power")
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

    def confirm_rotation(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        confirmation = server.ownership.confirm(args["rotation_id"])
        if confirmation.changed:
            cut = conn_auth.cut(confirmation.cut, f"rotation {confirmation.rotation_id} confirmed")
            log_event(
                "ownership_confirmed",
                f"credential rotation {confirmation.rotation_id} confirmed; the superseded credential is"
                f" refused from now on; closed {cut} connection(s) authenticated under it",
                ROTATION_ID=confirmation.rotation_id,
                CLOSED_CONNECTIONS=cut,
                PEER_PID=ctx.peer.pid,
            )
        return {"rotation_id": confirmation.rotation_id, "changed": confirmation.changed}

    def claim(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        server.ownership.claim(ctx.state.get("cred_id"))
        return {"unowned_period_s": server.unowned_period_s}

    async def ownership_shutdown(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_shutdown_fails")  # test fault, off unless $KANDEV_FAULT says so
        faults.hit("agentctl_lacks_shutdown")  # test fault: answers as a server without the op would
        # Already stopping (an unowned shutdown, an earlier call, a signal) counts as success (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7):
        # the reply still comes only once every instance is stopped.
        if server.ownership.begin_shutdown("ownership_shutdown"):
            server.exit_reason = server.exit_reason or "ownership_shutdown"
            log_event("agentctl_ownership_shutdown", "ownership_shutdown: stopping every instance, then exiting",
                      priority=5, PEER_PID=ctx.peer.pid)
        server.shutdown_calls += 1
        try:
            stopped = await instances.stop_all()
        finally:
            server.shutdown_calls -= 1
        server.spawn_background(_exit_after_reply(server, ctx, "ownership_shutdown"))
        return {"stopped": stopped}

    return {
        "identify": identify, "prove": prove, "auth_begin": auth_begin, "auth_finish": auth_finish,
        "rotate": rotate, "confirm_rotation": confirm_rotation, "claim": claim,
        "ownership_shutdown": ownership_shutdown,
    }


async def _exit_after_reply(server: ServerContext, ctx: ConnectionContext, reason: str) -> None:
    # Give the reply time to be written (or the client time to hang up) before closing.
    with contextlib.suppress(TimeoutError):
        await within(ctx.closed.wait(), SHUTDOWN_REPLY_GRACE)
    server.request_exit(reason)
