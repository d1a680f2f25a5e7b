"""Per-session credential and git endpoints: the only things of the backend an agent can reach.

An agent's git transport (``daemon.git_transport``) reads the session's lease file and checks it
with ``credential_redeem`` (and once ``credential_reissue``) on the socket named in its command
line (also ``$KANDEV_BACKEND_SOCKET``); the answer holds no credential. It then carries git's
protocol to the session's git endpoint, ``endpoint/git-proxy.sock`` (``daemon.backend.git.endpoint``,
``self.git``), opened and closed here with the credential endpoint. For agents this backend launches that socket is the session's
own endpoint, ``<home>/sessions/<sid>/endpoint/git.sock`` (``daemon.host.session_dirs``), whose
directory is bound read-only into the agent's sandbox. Each endpoint is a small ``IpcServer`` with
exactly those two ops, and serves exactly one session: a lease or capability of any other session
is refused (``scope_denied``) before the broker is asked. The broker (``daemon.credentials``)
still checks everything else (signature, expiry, revocation, scope, live session state).

Lifetime: an endpoint is opened before an agent of its session is launched (start, resume,
context-reset restart), re-opened for every session re-tracked after a backend restart (the
directory stays bound in the surviving agent's sandbox, the new backend binds a new socket in
it), and closed when the session's agent is gone and when the backend stops.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from daemon.backend.git.endpoint import GitProxy
from daemon.config.settings import CredentialsConfig
from daemon.core.limits import IDLE_CONNECTION_TIMEOUT_S
from daemon.credentials import ScopeDenied, redeem_lease, reissue_lease
from daemon.credentials.errors import CapabilityInvalid, off_loop_handler
from daemon.credentials.signing import decode_capability, existing_signing_key, lease_claims_unverified
from daemon.host.agent_user import AgentUserMissing, agent_user
from daemon.host.session_dirs import SessionDirs
from daemon.store.db import Store
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.schema import Op, OpTable
from ipc.server import IpcServer

log = logging.getLogger(__name__)

PROTOCOL = "kandev-git-credential"
VERSION = (1, 1)  # the helper checks the major version, like on the backend socket; 1.1: redeem answers no credential
TABLE = OpTable(PROTOCOL, VERSION, [
    Op("credential_redeem", required={"lease_token": str, "host": str, "path": str}, optional={"protocol": str},
       auth=False, doc="check this session's lease -> {lease_id, host, repository, expires_at} (no credential)"),
    Op("credential_reissue", required={"capability": str}, auth=False,
       doc="a new lease for this session's capability -> {lease_token, lease_id}"),
])
# The one socket an agent (untrusted) can reach: small bounds everywhere. A request is a few hundred
# bytes; git asks once per remote operation.
MAX_CONNECTIONS = 16
MAX_FRAME = 64 * 1024
MAX_INFLIGHT = 4
BUFFER_LIMIT = 1024 * 1024


class CredentialEndpoints:
    """The open endpoints of this backend, by session id."""

    def __init__(self, store: Store, home: Path, config: CredentialsConfig) -> None:
        self.store = store
        self.home = home
        self.config = config
        self._servers: dict[str, IpcServer] = {}
        self._lock = asyncio.Lock()
        self.git = GitProxy(store, config)  # each session's git endpoint, opened and closed with it

    def socket_path(self, session_id: str) -> Path:
        return SessionDirs.for_session(self.home, session_id).endpoint_socket

    @property
    def open_sessions(self) -> set[str]:
        return set(self._servers)

    async def open(self, session_id: str) -> Path:
        """Serve ``session_id``'s endpoint (idempotent); its directories are created if missing."""
        async with self._lock:
            if session_id not in self._servers:
                try:
                    dirs = await asyncio.to_thread(SessionDirs.for_session(self.home, session_id).ensure)
                    agent = agent_user()  # the session's agent connects (kandev-agent when we are root)
                    server = IpcServer(dirs.endpoint_socket, TABLE, self._handlers(session_id), socket_mode=0o600,
                                       max_connections=MAX_CONNECTIONS, max_frame=MAX_FRAME,
                                       max_inflight_per_connection=MAX_INFLIGHT,
                                       idle_timeout=IDLE_CONNECTION_TIMEOUT_S, buffer_limit=BUFFER_LIMIT,
                                       allowed_uids={os.getuid(), 0, agent.uid})
                    await server.start()
                    if agent.dedicated:
                        os.chown(dirs.endpoint_socket, agent.uid, agent.gid, follow_symlinks=False)
                    await asyncio.to_thread(self.git.open, session_id, dirs.proxy_socket)
                    if agent.dedicated:
                        os.chown(dirs.proxy_socket, agent.uid, agent.gid, follow_symlinks=False)
                except (OSError, ValueError, AgentUserMissing) as exc:  # e.g. socket paths too long
                    await asyncio.to_thread(self.git.close, session_id)
                    raise IpcError(ErrorCode.INVALID_ARGUMENT,
                                   f"cannot serve session {session_id}'s git credential endpoint: {exc}") from None
                self._servers[session_id] = server
            return Path(self._servers[session_id].path)

    async def close(self, session_id: str) -> None:
        async with self._lock:
            server = self._servers.pop(session_id, None)
        if server is not None:
            await server.close()
        await asyncio.to_thread(self.git.close, session_id)

    async def close_all(self) -> None:
        for session_id in list(self._servers):
            await self.close(session_id)
        await asyncio.to_thread(self.git.close_all)

    def close_soon(self, session_id: str) -> None:
        """``close`` from synchronous code (an execution that just went away)."""
        if session_id in self._servers:
            asyncio.get_running_loop().create_task(self.close(session_id), name=f"endpoint-close-{session_id}")

    async def reopen_for(self, session_ids: list[str]) -> None:
        """After recovery: an endpoint for every tracked session that has a lease file. The lease
        files are looked for in one trip off the loop (a trip per session cost a restart with
        1,000 re-tracked sessions 0.2 s)."""
        with_lease = await asyncio.to_thread(self._with_lease_file, session_ids)
        for sid in with_lease:
            try:
                await self.open(sid)
            except IpcError as exc:
                log.error("session %s: cannot serve its credential endpoint: %s", sid, exc)

    def _with_lease_file(self, session_ids: list[str]) -> list[str]:
        return [sid for sid in session_ids if SessionDirs.for_session(self.home, sid).lease_file.exists()]

    # ------------------------------------------------------------ the two ops

    def _handlers(self, session_id: str) -> dict[str, Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]]:
        store, config = self.store, self.config

        def redeem(args: dict[str, Any]) -> dict[str, Any]:
            claims = lease_claims_unverified(args["lease_token"])  # LeaseInvalid when malformed
            if claims.session_id != session_id:
                raise ScopeDenied(f"this endpoint serves session {session_id} only; the lease is another session's")
            with store.session() as db:
                r = redeem_lease(db, args["lease_token"], args["host"], args["path"], config=config,
                                 protocol=args.get("protocol") or "https")
                if r.session_id != session_id:  # cannot differ from the verified claims; never serve it
                    raise ScopeDenied(f"this endpoint serves session {session_id} only")
                # A check only: the upstream token is used by the git endpoint, never handed out.
                return {"lease_id": r.lease_id, "host": r.host, "repository": r.repository,
                        "expires_at": r.expires_at}

        def reissue(args: dict[str, Any]) -> dict[str, Any]:
            with store.session() as db:
                key = existing_signing_key(db)
                if key is None:
                    raise CapabilityInvalid("no capability was ever issued by this installation")
                if decode_capability(key, args["capability"]).session_id != session_id:
                    raise ScopeDenied(f"this endpoint serves session {session_id} only;"
                                      " the capability is another session's")
                token, lease_id = reissue_lease(db, args["capability"], config=config)
                return {"lease_token": token, "lease_id": lease_id}

        return {"credential_redeem": off_loop_handler(redeem), "credential_reissue": off_loop_handler(reissue)}
