"""Recovery in bulk: the per-record reads and writes of startup recovery, coalesced.

Startup recovery (``daemon.backend.recovery.recovery``) decides every record in its own task, so the
deadline, the guards and the per-record outcomes stay exactly what they are for one record. What
those tasks ask of the control server and of the store is coalesced here:

- ``TurnStatusReader``: the turn-status reads of every record that asks in the same loop
  iteration go to the server as one ``turn_statuses`` request per ``STATUS_CHUNK`` instances
  (protocol 1.2), each request on the read budget (timeout T, R retries) like a single read was;
  an older server (1.1, release 0.2.0) gets the per-instance ``turn_status`` reads it always got.
  An instance the server does not know fails its own read with ``not_found``, as before.
- ``WriteBatch``: the store writes of every record that is ready in the same loop iteration are
  applied in one transaction (the rows they touch loaded in one query per table first), then
  each record's follow-up (publication) runs, in the same callback: nothing else of the loop runs
  between a record's commit and its publication, so a deadline either precedes both or neither.
  A batch whose transaction fails is applied again record by record, so one bad record costs
  only itself, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.replies import TurnStatus
from daemon.store.db import Store
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

STATUS_CHUNK = 500
"""Instances per ``turn_statuses`` request (bounds the reply frame: a few hundred KiB at most)."""


class TurnStatusReader:
    """``read(instance_id)``, coalesced into ``turn_statuses`` requests (see the module doc).

    ``budget`` runs one request on the read budget (``Adopter.budget``)."""

    def __init__(self, client: AgentctlClient, budget: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> None:
        self._client = client
        self._budget = budget
        self._bulk = client.supports_turn_statuses
        self._waiting: dict[str, list[asyncio.Future[TurnStatus]]] = {}
        self._scheduled = False

    async def read(self, instance_id: str) -> TurnStatus:
        """The instance's ``{current_turn_id, outcomes}``; ``IpcError`` as a single read raises it."""
        if not self._bulk:
            result: TurnStatus = await self._budget(lambda: self._client.turn_status(instance_id))
            return result
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TurnStatus] = loop.create_future()
        self._waiting.setdefault(instance_id, []).append(fut)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._send)
        return await fut

    def _send(self) -> None:
        self._scheduled = False
        waiting, self._waiting = self._waiting, {}
        ids = list(waiting)
        loop = asyncio.get_running_loop()
        for start in range(0, len(ids), STATUS_CHUNK):
            chunk = {iid: waiting[iid] for iid in ids[start : start + STATUS_CHUNK]}
            task = loop.create_task(self._read_chunk(chunk))
            task.add_done_callback(_retrieve)

    async def _read_chunk(self, chunk: dict[str, list[asyncio.Future[TurnStatus]]]) -> None:
        ids = list(chunk)
        try:
            reply = await self._budget(lambda: self._client.turn_statuses(ids))
        except IpcError as exc:
            if exc.code != ErrorCode.UNKNOWN_OP:
                _settle(chunk.values(), exc)
                return
            self._bulk = False  # an older server after all (e.g. replaced meanwhile): one read each
            for iid, futs in chunk.items():
                asyncio.get_running_loop().create_task(self._read_one(iid, futs)).add_done_callback(_retrieve)
            return
        except BaseException as exc:  # cancelled, or a bug: nobody may wait forever
            _settle(chunk.values(), exc)
            raise
        statuses = reply.get("statuses") if isinstance(reply, dict) else None
        if not isinstance(statuses, dict):
            statuses = {}
        for iid, futs in chunk.items():
            status = statuses.get(iid)
            if isinstance(status, dict):
                for fut in futs:
                    if not fut.done():
                        fut.set_result(status)  # type: ignore[arg-type]
            else:
                _settle([futs], IpcError(ErrorCode.NOT_FOUND, f"no instance {iid!r}"))

    async def _read_one(self, instance_id: str, futs: list[asyncio.Future[TurnStatus]]) -> None:
        try:
            status: TurnStatus = await self._budget(lambda: self._client.turn_status(instance_id))
        except BaseException as exc:
            _settle([futs], exc)
            if not isinstance(exc, Exception):
                raise
            return
        for fut in futs:
            if not fut.done():
                fut.set_result(status)


def _settle(groups: Iterable[list[asyncio.Future[Any]]], exc: BaseException) -> None:
    for futs in groups:
        for fut in futs:
            if not fut.done():
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(exc)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("turn-status read failed", exc_info=task.exception())


@dataclass
class _Write:
    key: str
    apply: Callable[[Session], None]
    after: Callable[[], None]
    done: asyncio.Future[bool]


class WriteBatch:
    """``write(key, apply, after)``: ``apply(db)`` in a transaction shared with the other records
    ready in the same loop iteration, then ``after()`` once it committed (see the module doc).

    ``admit()`` is asked at the flush: False (the deadline passed) and no write of the batch runs
    (``write`` returns False). ``preload(db, keys)`` loads what the batch's writes will touch and
    returns it (kept referenced until the commit)."""

    def __init__(
        self,
        store: Store,
        *,
        admit: Callable[[], bool],
        preload: Callable[[Session, list[str]], list[Any]] | None = None,
    ) -> None:
        self._store = store
        self._admit = admit
        self._preload = preload
        self._queue: list[_Write] = []

    async def write(self, key: str, apply: Callable[[Session], None], after: Callable[[], None]) -> bool:
        """True once ``apply`` committed and ``after`` ran; False if the batch was not admitted.
        An exception of ``apply`` (in its own transaction, after a failed batch) is raised here."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        if not self._queue:
            loop.call_soon(self._flush)
        self._queue.append(_Write(key, apply, after, done))
        return await done

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        batch = [w for w in batch if not w.done.done()]  # a cancelled waiter's write is dropped
        if not batch:
            return
        if not self._admit():
            for w in batch:
                w.done.set_result(False)
            return
        try:
            with self._store.session() as db:
                # referenced until the commit: the session's identity map holds rows weakly
                loaded = self._preload(db, [w.key for w in batch]) if self._preload is not None else []
                for w in batch:
                    w.apply(db)
                del loaded
            committed = batch
        except Exception:
            log.warning("a batch of %d recovery writes failed; applying them one by one", len(batch), exc_info=True)
            committed = []
            for w in batch:
                try:
                    with self._store.session() as db:
                        w.apply(db)
                except Exception as exc:
                    w.done.set_exception(exc)
                else:
                    committed.append(w)
        for w in committed:
            try:
                w.after()
            except Exception as exc:
                w.done.set_exception(exc)
            else:
                w.done.set_result(True)
