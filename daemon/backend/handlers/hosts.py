"""The ``hosts`` op (``kandev hosts``, Issue 47 item 3): every host of the cluster, its state
(``ready``, ``unreachable`` since when, ``stopped``), version, sessions, agents and last heartbeat,
read from the shared store (``daemon.backend.cluster.membership``); and ``status``'s ``cluster``."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from daemon.backend.lifetime.context import BackendContext
from ipc.server import ConnectionContext, Handler


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def read_hosts(backend: BackendContext) -> dict[str, Any]:
    """The hosts, by name, with their counts (a worker thread; one store session)."""
    cluster = backend.cluster
    own = cluster.identity.host
    if own is None:
        return {"host": None, "hosts": []}
    with backend.store.session() as db:
        states = cluster.directory.states(db)
        counts = cluster.directory.counts(db)
    hosts = []
    for name in sorted(states):
        r, c = states[name], counts.get(name)
        hosts.append({"name": name, "state": r.state, "since": _iso(r.since), "last_heartbeat": _iso(r.last_heartbeat),
                      "version": r.version, "pid": r.pid, "machine": r.machine,
                      "sessions": c.sessions if c else 0, "agents": c.agents if c else 0, "own": name == own})
    return {"host": own, "hosts": hosts}


def handlers(backend: BackendContext, status: Handler) -> dict[str, Handler]:
    """``hosts``, and ``status`` (the handler of ``daemon.backend.handlers.status``) with its
    ``cluster`` part: this host and the others by state (None on a single host)."""
    async def op_hosts(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(read_hosts, backend)

    async def op_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        result, cluster = await asyncio.gather(status(ctx, args),
                                               asyncio.to_thread(backend.cluster.directory.summary))
        return {**result, "cluster": cluster}

    return {"hosts": op_hosts, "status": op_status}
