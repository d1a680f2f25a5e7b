"""One cluster backend's messaging through PostgreSQL (Issue 47 item 2, Issue 47 item 3), started and stopped together.

- ``router`` (``daemon.backend.cluster.router``): ops on other hosts' sessions become requests;
- ``runner`` (``daemon.backend.cluster.runner``): this host's requests are carried out;
- ``listener`` (``daemon.backend.cluster.listener``): one LISTEN connection wakes the runner
  (``kandev_requests`` naming this host), the router (``kandev_results``) and the ``follow`` streams
  of other hosts' sessions (``kandev_transcript``, through the ``TranscriptHub`` local commits use);
  every commit of this backend that changes a transcript or turn NOTIFYs ``kandev_transcript``.

``start`` runs when startup recovery begins (followers and requesters are woken from then on);
``serve_requests`` once the backend is ready (a request then meets a recovered backend, and the
requests written while it was down are claimed); ``stop`` at shutdown, before the store closes.
A single-host backend (SQLite, or no ``cluster.host``) builds none of this: ``refuse_hosts`` makes
its ``session_start`` refuse ``host``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from daemon.backend.cluster import requests
from daemon.backend.cluster.listener import NotifyListener, announce_transcript_commits
from daemon.backend.cluster.membership import Reachability
from daemon.backend.cluster.router import Router
from daemon.backend.cluster.runner import RequestRunner
from daemon.store.db import Store
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext, Handler


class FollowerHub(Protocol):
    """The follow streams' wake-ups (``daemon.backend.state.transcript_hub.TranscriptHub``)."""

    def notify(self, session_ids: Iterable[str]) -> None: ...

    def watched(self) -> list[str]: ...


class ClusterMessaging:
    """The router, the runner and the listener of one cluster backend (see the module doc)."""

    def __init__(self, store: Store, host: str, reachability: Callable[[str], Reachability | None],
                 hub: FollowerHub) -> None:
        self.host = host
        self.hub = hub
        self.router = Router(store, host, reachability)
        self.runner = RequestRunner(store, host)
        self.listener = NotifyListener(store.engine, self._notified, self._connected)
        announce_transcript_commits(store)
        self._serving = False

    def wrap(self, table: dict[str, Handler]) -> dict[str, Handler]:
        """The handler table with the routed ops going to their hosts."""
        return self.router.wrap(table)

    def use(self, handlers: dict[str, Handler]) -> None:
        """The table the socket serves, which the runner uses for requests too."""
        self.runner.use(handlers)

    def start(self) -> None:
        self.listener.start()

    async def serve_requests(self) -> None:
        await self.runner.start()
        self._serving = True

    async def stop(self) -> None:
        await self.runner.stop()
        await self.listener.stop()

    def _notified(self, channel: str, payload: str) -> None:
        if channel == requests.REQUESTS_CHANNEL:
            if payload == self.host and self._serving:
                self.runner.wake()
        elif channel == requests.RESULTS_CHANNEL:
            if payload.isdigit():
                self.router.answered(int(payload))
        elif channel == requests.TRANSCRIPT_CHANNEL:
            self.hub.notify([payload])

    def _connected(self) -> None:
        """(Re)connected: whatever was notified meanwhile is read again."""
        if self._serving:
            self.runner.wake()
        self.router.reconnected()
        self.hub.notify(self.hub.watched())


def refuse_hosts(table: dict[str, Handler]) -> dict[str, Handler]:
    """A single-host backend's table: ``session_start`` with ``host`` is refused, naming what it needs."""
    start = table.get("session_start")
    if start is None:
        return table

    async def session_start(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
        if args.get("host"):
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"host {args['host']!r}: this backend is a single host;"
                           " --host needs cluster mode ([cluster] host and a PostgreSQL database.url)")
        return await start(ctx, args)

    return {**table, "session_start": session_start}
