"""The owning side of a cluster request (Issue 47 item 2, Issue 47 item 6): this host's backend carries out the
requests other hosts wrote for it.

``RequestRunner.start`` first answers the requests this host had claimed and never answered (its
backend died meanwhile: ``request_interrupted``, never run twice; ``requests.answer_interrupted``),
then claims every pending request, including those written while it was down. After that it claims
when woken by a ``kandev_requests`` notification naming this host, and looks every ``SCAN_S`` seconds
anyway (a notification lost with a dropped connection).

Each claimed request runs in a task of its own (a ``prompt --wait`` does not hold up the others;
``MAX_RUNNING`` at most at once) through exactly what a local CLI call goes through after the
socket: the op must be one of
``router.ROUTED_OPS`` (nothing else is accepted from another host: ``permission_denied``), its
arguments are validated by the op table (``invalid_argument`` naming the field, as on the socket),
then the backend's own handler table runs it, with the same id resolution, checks and typed errors.
The answer (or the typed error) is written back with ``requests.finish``. Answered requests are
removed a day later (``KEEP_DONE_S``). A graceful stop answers
the requests still running ``request_interrupted`` too, before the backend exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import time
from typing import Any

from daemon.api.ops import TABLE
from daemon.backend.cluster import requests
from daemon.backend.cluster.router import FROM_REQUEST, ROUTED_OPS
from daemon.core.journal import log_event
from daemon.store.db import Store
from ipc.aio import within
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.peercred import PeerCredentials
from ipc.server import Handler

log = logging.getLogger(__name__)

SCAN_S = 5.0
"""Seconds between two looks for pending requests without a notification."""
MAX_RUNNING = 64
"""Requests carried out at once at most (as the CLI socket runs at most 64 requests of a connection);
the others wait, pending, until one ends."""
KEEP_DONE_S = 86400.0
"""Seconds an answered request stays in the store (for someone looking into what happened)."""
FORGET_EVERY_S = 600.0
"""Seconds between two removals of the answered requests older than ``KEEP_DONE_S`` (any host's)."""


class _NoTransport(asyncio.WriteTransport):
    """A request from the queue has no socket: nothing is ever written to it."""

    def write(self, data: Any) -> None:
        raise RuntimeError("a cluster request has no connection to write to")

    def is_closing(self) -> bool:
        return False


class RequestRunner:
    """Claims and carries out this host's requests (see the module doc)."""

    def __init__(self, store: Store, host: str) -> None:
        self.store = store
        self.host = host
        self._handlers: dict[str, Handler] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: dict[int, asyncio.Task[None]] = {}
        self.carried_out = 0

    def use(self, handlers: dict[str, Handler]) -> None:
        """The handler table the CLI socket serves (the same for requests)."""
        self._handlers = handlers

    def wake(self) -> None:
        self._wake.set()

    async def start(self) -> None:
        interrupted = await asyncio.to_thread(self._answer_interrupted)
        if interrupted:
            log_event("cluster_requests_interrupted",
                      f"{len(interrupted)} request(s) from other hosts were under way when this backend stopped:"
                      " answered request_interrupted (not run again)", priority=4, REQUESTS=",".join(map(str, interrupted)))
        self._wake.set()
        self._task = asyncio.create_task(self._loop(), name="cluster-requests")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = list(self._running.items())
        for _request_id, task in running:
            task.cancel()
        for _request_id, task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if running:
            await asyncio.to_thread(self._answer_interrupted)

    def _answer_interrupted(self) -> list[int]:
        with self.store.session() as db:
            ids = requests.answer_interrupted(db, self.host)
            db.commit()
        return ids

    def _claim(self) -> requests.Request | None:
        with self.store.session() as db:
            request = requests.claim(db, self.host)
            db.commit()
        return request

    def _finish(self, request_id: int, result: dict[str, Any] | None, error: dict[str, Any] | None) -> None:
        with self.store.session() as db:
            requests.finish(db, request_id, result=result, error=error)
            db.commit()

    def _forget_done(self) -> int:
        with self.store.session() as db:
            removed = requests.forget_done(db, KEEP_DONE_S)
            db.commit()
        return removed

    async def _loop(self) -> None:
        forgot = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await within(self._wake.wait(), SCAN_S)
            self._wake.clear()
            try:
                if time.monotonic() - forgot >= FORGET_EVERY_S:
                    forgot = time.monotonic()
                    await asyncio.to_thread(self._forget_done)
                while len(self._running) < MAX_RUNNING and (request := await asyncio.to_thread(self._claim)):
                    task = asyncio.create_task(self._carry_out(request), name=f"cluster-request-{request.id}")
                    self._running[request.id] = task
                    task.add_done_callback(functools.partial(self._forget, request.id))
            except Exception as exc:  # the store is away: the next look tries again
                log.warning("cluster requests: claiming failed: %s", exc)

    def _forget(self, request_id: int, _task: asyncio.Task[None]) -> None:
        if self._running.pop(request_id, None) is not None and len(self._running) == MAX_RUNNING - 1:
            self._wake.set()  # room again for one that waits

    async def _carry_out(self, request: requests.Request) -> None:
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        try:
            result = await self.run(request)
        except IpcError as exc:
            error = requests.error_dict(exc)
        except Exception as exc:
            log.exception("cluster request %d (%s from %s) failed", request.id, request.op, request.origin_host)
            error = requests.error_dict(IpcError(ErrorCode.INTERNAL, f"{request.op} failed on host {self.host}:"
                                                 f" {type(exc).__name__}"))
        self.carried_out += 1
        try:
            await asyncio.to_thread(self._finish, request.id, result, error)
        except Exception as exc:  # the row stays running: answered request_interrupted at the next start
            log.warning("cluster request %d: its answer could not be written: %s", request.id, exc)

    async def run(self, request: requests.Request) -> dict[str, Any]:
        """Validate and run one request through the backend's handler table: its JSON answer."""
        if request.op not in ROUTED_OPS:
            raise IpcError(ErrorCode.PERMISSION_DENIED, f"{request.op!r} is not an op another host may ask"
                           f" host {self.host} to carry out")
        args = TABLE.get(request.op).validate(request.args)  # invalid_argument naming the field
        handler = self._handlers[request.op]
        ctx = ConnectionContext(PeerCredentials(pid=0, uid=os.getuid(), gid=os.getgid()), _NoTransport())
        ctx.state[FROM_REQUEST] = request.id
        answer = handler(ctx, args)
        if inspect.isawaitable(answer):
            answer = await answer
        if answer is None:
            return {}
        if not isinstance(answer, dict):
            raise IpcError(ErrorCode.INTERNAL, f"{request.op} answered a {type(answer).__name__}, not a map")
        try:
            return dict(json.loads(json.dumps(answer, allow_nan=False)))
        except (TypeError, ValueError) as exc:
            raise IpcError(ErrorCode.INTERNAL, f"{request.op}'s answer cannot be carried in JSON: {exc}") from exc
