"""The requesting side of a cluster request (Issue 47 item 2): an op on a session another host owns
goes to that host through the store.

``Router.wrap`` wraps the backend's handler table. For each op in ``ROUTED_OPS`` it looks up which
host owns the session (``task_sessions.host``, which never changes once set: remembered);
``session_start`` names a host with ``host``; ``task_proceed`` goes to the host of the task's latest
session. A session of this host (or of a single-host store, host NULL) runs the local handler as
before. Otherwise:

1. the target host's reachability (``HostDirectory``): not ``ready`` is the typed error
   ``host_unreachable`` at once, naming the host and since when; nothing is written;
2. the request row is written and the target woken (``requests.enqueue``);
3. the router waits for the answer: woken by the ``kandev_results`` notification, and it reads the
   row again every ``RECHECK_S`` seconds anyway (a notification lost with a dropped connection);
4. not claimed within ``CLAIM_BOUND_S``: the request is taken back (``requests.give_up``: it is
   never run) and the answer is ``host_unreachable``; claimed, the router waits up to the op's own
   bound (``OP_BOUNDS_S``; a ``prompt`` with ``wait`` for as long as the turn runs), and while it
   waits a host that stops heartbeating is ``host_unreachable`` too, saying the op may have run;
5. the answer is returned exactly as the owner's handler returned it, or its typed error raised
   with the same code, message, retryability and details: the CLI prints both as for a local session.

A request the owning backend runs is served by the same wrapped table, marked as coming from the
queue (``FROM_REQUEST``): if the session belongs to yet another host, that is a ``conflict``, never
a second hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import select

from daemon.backend.cluster import requests
from daemon.backend.cluster.membership import Reachability
from daemon.store.db import Store
from daemon.store.models import TaskSession
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext, Handler

ROUTED_OPS = frozenset({
    "session_start", "prompt", "cancel", "permission_respond", "session_stop", "session_resume",
    "session_reset_context", "session_configure", "session_logs", "task_proceed",
})
"""The ops carried out by the host that owns the session (and the only ones a request may carry);
``task_proceed`` by the host of the task's latest session (its step's reset and prompt drive it)."""
CLAIM_BOUND_S = 10.0
"""Seconds the owner has to claim a request before the requester takes it back (host_unreachable)."""
OP_BOUNDS_S = {"session_start": 175.0, "session_resume": 175.0, "session_reset_context": 175.0,
               "session_configure": 175.0}
"""Seconds a claimed request may take before its requester answers ``timeout`` (the CLI waits 180 s)."""
DEFAULT_BOUND_S = 55.0
"""The same for every other op (the CLI waits 60 s), except a ``prompt`` with ``wait``: unbounded."""
RECHECK_S = 1.0
"""Seconds between two reads of a request's row without a notification."""
REACHABILITY_EVERY_S = 5.0
"""Seconds between two looks at the owner's heartbeat while a claimed request runs."""
FROM_REQUEST = "cluster_request"
"""``ConnectionContext.state`` key: the id of the request this call carries out (owner side)."""


def unreachable(host: str, state: str, since: datetime | None, *, ran: str = "") -> IpcError:
    """The typed error ``host_unreachable`` naming the host and since when."""
    if state == "unknown":
        why = f"no host named {host!r} is part of this cluster (kandev hosts lists them)"
        return IpcError(ErrorCode.NOT_FOUND, why)
    when = f" since {since.isoformat()}" if since is not None else ""
    what = "stopped" if state == "stopped" else "unreachable"
    return IpcError(requests.HOST_UNREACHABLE, f"host {host} is {what}{when}: its backend drives its sessions,"
                    f" and it does not answer{ran}", True, {"host": host, "state": what,
                                                           "since": since.isoformat() if since else None})


class Router:
    """Sends the ops on other hosts' sessions through the store (see the module doc)."""

    def __init__(self, store: Store, host: str, reachability: Callable[[str], Reachability | None]) -> None:
        self.store = store
        self.host = host
        self._reachability = reachability
        self._owners: dict[str, str | None] = {}  # session id -> its host (it never changes)
        self._waiting: dict[int, asyncio.Event] = {}
        self.forwarded = 0

    # -- notifications (on the event loop) ----------------------------------------------------
    def answered(self, request_id: int) -> None:
        event = self._waiting.get(request_id)
        if event is not None:
            event.set()

    def reconnected(self) -> None:
        for event in self._waiting.values():
            event.set()

    # -- the handler table -------------------------------------------------------------------
    def wrap(self, table: dict[str, Handler]) -> dict[str, Handler]:
        out = dict(table)
        for name in ROUTED_OPS & table.keys():
            out[name] = self._routed(name, table[name])
        return out

    def _routed(self, op: str, local: Handler) -> Handler:
        async def route(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            target = await self._target(op, args)
            if target is None or target == self.host:
                result = local(ctx, args)
                return await result if inspect.isawaitable(result) else result
            if FROM_REQUEST in ctx.state:
                raise IpcError(ErrorCode.CONFLICT, f"this request reached host {self.host}, but the session"
                               f" belongs to host {target}: it is not passed on")
            return await self.forward(target, op, args)

        route.__name__ = getattr(local, "__name__", op)
        return route

    async def _target(self, op: str, args: dict[str, Any]) -> str | None:
        if op == "session_start":
            host = args.get("host")
            return host if isinstance(host, str) and host else None
        if op == "task_proceed":
            task_id = args.get("task_id")
            return await asyncio.to_thread(self._latest_host, task_id) if isinstance(task_id, str) else None
        session_id = args.get("session_id")
        if not isinstance(session_id, str):
            return None
        if session_id in self._owners:
            return self._owners[session_id]
        owner = await asyncio.to_thread(self._owner_of, session_id)
        if owner is not None:
            self._owners[session_id] = owner
        return owner

    def _latest_host(self, task_id: str) -> str | None:
        """The host of the task's latest session (``WorkflowRunner``'s order), read each time."""
        with self.store.session() as db:
            return db.scalar(select(TaskSession.host).where(TaskSession.task_id == task_id)
                             .order_by(TaskSession.created_at.desc(), TaskSession.id.desc()).limit(1))

    def _owner_of(self, session_id: str) -> str | None:
        with self.store.session() as db:
            return db.scalar(select(TaskSession.host).where(TaskSession.id == session_id))

    async def _check_reachable(self, host: str, *, ran: str = "") -> None:
        seen = await asyncio.to_thread(self._reachability, host)
        if seen is None:
            raise unreachable(host, "unknown", None)
        if seen.state != "ready":
            raise unreachable(host, seen.state, seen.since, ran=ran)

    # -- one request -------------------------------------------------------------------------
    async def forward(self, host: str, op: str, args: dict[str, Any]) -> Any:
        """Have ``host`` run ``op`` with ``args``: its answer, or its typed error raised here."""
        await self._check_reachable(host)
        request_id = await asyncio.to_thread(self._enqueue, host, op, args)
        self.forwarded += 1
        woken = self._waiting[request_id] = asyncio.Event()
        try:
            return await self._wait(request_id, woken, host, op, args)
        finally:
            del self._waiting[request_id]

    def _enqueue(self, host: str, op: str, args: dict[str, Any]) -> int:
        with self.store.session() as db:
            request_id = requests.enqueue(db, host=host, origin_host=self.host, op=op, args=args)
            db.commit()
        return request_id

    def _read(self, request_id: int) -> requests.Outcome | None:
        with self.store.session() as db:
            return requests.outcome(db, request_id)

    def _give_up(self, request_id: int, error: IpcError) -> bool:
        with self.store.session() as db:
            taken = requests.give_up(db, request_id, requests.error_dict(error))
            db.commit()
        return taken

    async def _wait(self, request_id: int, woken: asyncio.Event, host: str, op: str, args: dict[str, Any]) -> Any:
        start = time.monotonic()
        bound = None if op == "prompt" and args.get("wait") else OP_BOUNDS_S.get(op, DEFAULT_BOUND_S)
        claimed_at: float | None = None
        looked = start
        while True:
            woken.clear()
            out = await asyncio.to_thread(self._read, request_id)
            now = time.monotonic()
            if out is None:
                raise IpcError(ErrorCode.INTERNAL, f"request {request_id} to host {host} disappeared")
            if out.state == requests.DONE:
                if out.error is not None:
                    raise requests.error_of(out.error)
                return out.result if out.result is not None else {}
            if out.state == requests.PENDING and now - start >= CLAIM_BOUND_S:
                seen = await asyncio.to_thread(self._reachability, host)
                error = unreachable(host, seen.state if seen is not None and seen.state != "ready" else "unreachable",
                                    seen.since if seen is not None else None,
                                    ran=f" (request {request_id} was not taken up within {CLAIM_BOUND_S:g} s;"
                                        " it will not run)")
                if await asyncio.to_thread(self._give_up, request_id, error):
                    raise error
                continue  # claimed meanwhile: wait for its answer
            if out.state == requests.RUNNING:
                claimed_at = claimed_at or now
                if bound is not None and now - claimed_at >= bound:
                    raise IpcError(ErrorCode.TIMEOUT, f"host {host} took more than {bound:g} s over {op}"
                                   f" (request {request_id}); it may still take effect", True)
                if now - looked >= REACHABILITY_EVERY_S:
                    looked = now
                    await self._check_reachable(host, ran=f" (request {request_id} was under way: {op} may or"
                                                          " may not have taken effect)")
            with contextlib.suppress(TimeoutError):
                await within(woken.wait(), RECHECK_S)
