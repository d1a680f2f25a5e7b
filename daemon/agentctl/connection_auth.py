"""Which connection may do what: the per-connection side of ownership.

Owns the connection's authentication state (``ctx.state``: ``authenticated``, the ``cred_id``
that authenticated it, the pending ``nonce``) and the three things done with it:

- ``authenticate``: check a proof against the connection's pending nonce (consumed: one attempt
  per nonce); success remembers WHICH credential authenticated the connection, failure leaves
  it unauthenticated, whatever it was before;
- ``authorize``: the ipc layer's gate for every op declared ``auth=True``; the connection's power
  is judged at each request by ``Ownership.check`` (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6,
  AC-EXECUTORS-CONTROL-OWNERSHIP-002.7);
- ``cut``: abort every connection and stream authenticated under a credential that stopped
  authenticating anything (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2).

The credentials themselves and their rotation are ``daemon.agentctl.ownership``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from daemon.agentctl.server_context import ServerContext
from daemon.core.journal import log_event
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.schema import Op

log = logging.getLogger("kandev.agentctl.server")


def authenticated(ctx: ConnectionContext) -> bool:
    return ctx.state.get("authenticated") is True


class ConnectionAuth:
    """Authentication of connections against the launch's ``Ownership``."""

    def __init__(self, server: ServerContext) -> None:
        self.server = server

    def authorize(self, ctx: ConnectionContext, op: Op) -> None:
        server = self.server
        if ctx.state.get("authenticated") is not True:
            log.debug("conn %d (pid %d) op %s refused: unauthenticated", server.conn_id(ctx), ctx.peer.pid, op.name)
            raise IpcError(
                ErrorCode.UNAUTHENTICATED,
                f"{op.name} needs an authenticated connection (prove, then auth_begin and auth_finish)",
            )
        try:
            # The op name is the purpose: only rotate and ownership_shutdown accept the superseded one.
            server.ownership.check(ctx.state.get("cred_id"), op.name)
        except IpcError:
            log.debug("conn %d (pid %d) op %s refused: superseded credential", server.conn_id(ctx), ctx.peer.pid,
                      op.name)
            raise

    def authenticate(self, ctx: ConnectionContext, proof: Any, op: str) -> int:
        """Check ``proof`` against this connection's pending nonce (consumed: one attempt per nonce).

        Success: the connection is authenticated under the matching credential (its id is kept).
        Failure: the connection is left unauthenticated, whatever it was before.
        """
        nonce = ctx.state.pop("nonce", None)
        ctx.state["authenticated"] = False
        ctx.state.pop("cred_id", None)
        if nonce is None:
            raise IpcError(ErrorCode.UNAUTHENTICATED, f"{op} without a pending auth_begin nonce")
        cred_id = self.server.ownership.match_connection_proof(nonce, self.server.server_identity, proof)
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

    def cut(self, cred_ids: frozenset[int], why: str) -> int:
        """Abort every connection and stream authenticated under one of ``cred_ids`` (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2)."""
        if not cred_ids:
            return 0
        cut = 0
        for conn in self.server.connections():
            if conn.state.get("authenticated") is True and conn.state.get("cred_id") in cred_ids:
                conn.state["authenticated"] = False
                log.debug("conn %d: closed (%s)", self.server.conn_id(conn), why)
                conn.abort()  # not close(): nothing still queued for the old holder is delivered
                cut += 1
        return cut
