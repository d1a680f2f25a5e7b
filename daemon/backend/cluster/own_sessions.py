"""Only the owning host's backend drives a session (Issue 47 item 1, Issue 47 item 6).

``own_sessions_only`` wraps the operations that drive a session's agent (a prompt, cancel, a
permission answer, stop, resume, configure, a context reset): on a session another cluster host
drives, this backend refuses before the handler runs, so nothing here ever talks to another host's
agent (its control server is on that machine): ``host_unreachable`` (naming the host and since
when) for a host that is not ready, ``other_host`` (naming it) otherwise. A request the other host
carries out (the request path through the database) reaches that host's own handlers, where the
session is its own. On a single host every operation passes untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import select

from daemon.backend.cluster.membership import READY, Cluster
from daemon.store.db import Store
from daemon.store.models import TaskSession
from ipc.errors import IpcError
from ipc.server import ConnectionContext

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]

DRIVING_OPS = ("prompt", "cancel", "permission_respond", "session_stop", "session_resume", "session_configure",
               "session_reset_context")
HOST_UNREACHABLE = "host_unreachable"
OTHER_HOST = "other_host"


def refusal(cluster: Cluster, store: Store, session_id: str) -> IpcError | None:
    """Why this backend must not drive ``session_id`` (None: it is this host's, or no such session:
    the handler says so). A blocking read."""
    with store.session() as db:
        host = db.scalar(select(TaskSession.host).where(TaskSession.id == session_id))
    if cluster.identity.owns(host) or host is None:
        return None
    seen = cluster.directory.reachability(host)
    if seen is None or seen.state != READY:
        since = f" since {seen.since.isoformat()}" if seen is not None and seen.since is not None else ""
        state = seen.state if seen is not None else "unknown"
        return IpcError(HOST_UNREACHABLE, f"session {session_id} is driven by cluster host {host}, which is {state}"
                        f"{since}: nothing was done (its agent may still run there; `kandev hosts` shows the"
                        " hosts)", True)
    return IpcError(OTHER_HOST, f"session {session_id} is driven by cluster host {host}: this backend does not"
                    f" drive another host's agents (run the command on {host})", False)


def own_sessions_only(cluster: Cluster, store: Store, table: dict[str, Handler]) -> dict[str, Handler]:
    """``table`` with its driving operations refused on another host's sessions (cluster mode only)."""
    if not cluster.identity.enabled:
        return table

    def guarded(handler: Handler) -> Handler:
        async def handle(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            refused = await asyncio.to_thread(refusal, cluster, store, str(args.get("session_id")))
            if refused is not None:
                raise refused
            return await handler(ctx, args)
        return handle

    return {name: guarded(h) if name in DRIVING_OPS else h for name, h in table.items()}
