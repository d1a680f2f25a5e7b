"""Event streams of many instances on one connection: the backend's side of ``attach_many``.

``SharedAttacher.attach`` is asked for one instance's stream, like ``AgentctlClient.attach``, and
answers an ``InstanceStream`` that reads like one (``batch``, ``close``, ``result``). The attaches
asked in the same moment (what the event consumers of a recovery all ask at once) go out together,
as one ``attach_many`` on one new connection with one handshake, instead of a connection and a
handshake each. A ``SharedStream`` reads that connection and hands each instance's events to its
``InstanceStream``.

What each consumer sees is what it sees of its own ``attach``:
- its events in seq order; ``[]`` from ``batch`` when its stream ended (a newer attach of the
  instance, or the instance stopped); the connection's error when the connection failed (every
  instance on it gets it: each consumer attaches again, and those attaches go out together too);
- an instance the server does not have fails its attach with ``not_found``;
- ``close`` stops the consumer's reading (what still arrives for it is dropped, unacknowledged,
  so the server keeps it); ``detach`` also ends the server's stream of that instance, so an
  instance whose events cannot be stored (a full disk) is detached and its agent parks at the
  detached bound, while the others go on. The last ``close`` closes the connection.

Memory is bounded as with a connection of its own: once an instance has ``QUEUE_HIGH`` events
waiting for its consumer, the shared connection is not read until the consumer took them, so the
server's writes wait and the agents' output is retained there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from daemon.agentctl.protocol import ATTACH_MANY_MAX
from ipc.client import Event, EventStream, batch_events
from ipc.errors import ErrorCode, IpcError
from ipc.framing import InvalidFrame

log = logging.getLogger(__name__)

QUEUE_HIGH = 4096
"""Events waiting for one consumer at which the shared connection stops being read."""
FRAMES_PER_READ = 64


class InstanceStream:
    """One instance's events from a shared stream, read as an ``attach`` stream is read."""

    def __init__(self, shared: SharedStream, instance_id: str, result: dict[str, Any]) -> None:
        self.instance_id = instance_id
        self.result = {"instance_id": instance_id, "next_seq": result.get("next_seq"),
                       "retained_events": result.get("retained_events")}
        self.token = str(result.get("stream"))
        self._shared = shared
        self._events: deque[Event] = deque()
        self._ended = False
        self._error: IpcError | None = None
        self._closed = False
        self._changed = asyncio.Event()  # events or the end arrived
        self.taken = asyncio.Event()  # the consumer took events (or closed): the connection may be read
        self.taken.set()

    # -- fed by the shared stream -------------------------------------------

    def push(self, events: list[Event]) -> None:
        if self._closed or self._ended:
            return  # no longer read: the server keeps what was not acknowledged
        self._events.extend(events)
        self._changed.set()
        if len(self._events) >= QUEUE_HIGH:
            self.taken.clear()

    def end(self, error: IpcError | None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._changed.set()
            self.taken.set()

    # -- read by the consumer -----------------------------------------------

    async def batch(self, limit: int) -> list[Event]:
        """Wait for events, then take those already received (at most ``limit``, in order); ``[]``
        once the stream ended; the connection's error, if that ended it, once the events before it
        are taken."""
        if limit < 1:
            raise ValueError(f"batch limit must be >= 1, not {limit}")
        while not self._events:
            if self._closed:
                return []
            if self._ended:
                error, self._error = self._error, None
                self.stop_reading()
                if error is not None:
                    raise error
                return []
            self._changed.clear()
            await self._changed.wait()
        events = [self._events.popleft() for _ in range(min(limit, len(self._events)))]
        if len(self._events) < QUEUE_HIGH:
            self.taken.set()
        return events

    def __aiter__(self) -> InstanceStream:
        return self

    async def __anext__(self) -> Event:
        events = await self.batch(1)
        if not events:
            raise StopAsyncIteration
        return events[0]

    async def close(self) -> None:
        """Stop reading (idempotent); the server's stream of the instance goes on unread until the
        connection closes, which the last ``close`` on it does."""
        self.stop_reading()

    def stop_reading(self) -> None:
        """``close``, for code that cannot wait."""
        if not self._closed:
            self._closed = True
            self._events.clear()
            self._changed.set()
            self.taken.set()
            self._shared.forget(self)

    async def detach(self) -> None:
        """``close``, and end the server's stream of this instance (unless it has ended)."""
        ended = self._ended
        self.stop_reading()
        if not ended:
            await self._shared.detach(self.instance_id, self.token)


class SharedStream:
    """One ``attach_many`` connection, routing its frames to each instance's ``InstanceStream``."""

    def __init__(self, stream: EventStream, detach: Callable[[str, str], Awaitable[Any]]) -> None:
        result = stream.result if isinstance(stream.result, dict) else {}
        attached = result.get("attached")
        if not isinstance(attached, dict):
            attached = {}
        self.streams: dict[str, InstanceStream] = {
            str(iid): InstanceStream(self, str(iid), info if isinstance(info, dict) else {})
            for iid, info in attached.items()
        }
        self._stream = stream
        self._detach = detach
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="shared-event-stream")

    async def _read(self) -> None:
        error: IpcError | None = None
        try:
            while self.streams:
                frames = await self._stream.frames(FRAMES_PER_READ)
                if not frames:
                    break
                for frame in frames:
                    target = self._route(frame)
                    if target is not None and not target.taken.is_set():
                        await target.taken.wait()  # bounded memory: wait for that consumer
        except IpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = IpcError(ErrorCode.UNAVAILABLE, "shared event stream closed")
            raise
        finally:
            for target in list(self.streams.values()):
                target.end(error.copy() if error is not None else None)
            await self._stream.close()

    def _route(self, frame: dict[str, Any]) -> InstanceStream | None:
        iid = frame.get("instance")
        if not isinstance(iid, str):
            if frame.get("ok") is False:
                raise IpcError.from_wire(frame.get("error"))  # the stream ended with an error
            raise InvalidFrame("frame without an instance on a shared event stream")
        target = self.streams.get(iid)
        if frame.get("end") is True:
            if target is not None:
                target.end(None)
            return None
        events = batch_events(frame.get("events"))
        if target is None:
            return None  # closed by its consumer: dropped, unacknowledged
        target.push(events)
        return target

    def forget(self, target: InstanceStream) -> None:
        if self.streams.get(target.instance_id) is target:
            del self.streams[target.instance_id]
        if not self.streams:
            self._reader.cancel()  # nobody reads: the connection closes, the server detaches the rest

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the connection is closed."""
        self._reader.add_done_callback(lambda _: callback())

    async def detach(self, instance_id: str, token: str) -> None:
        try:
            await self._detach(instance_id, token)
        except IpcError as exc:  # the connection is gone too, or the server: either way not streaming
            log.debug("detach of %s's stream failed: %s", instance_id, exc)

    async def close(self) -> None:
        for target in list(self.streams.values()):
            target.stop_reading()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


_Pending = tuple[str, int, "asyncio.Future[InstanceStream]"]


class SharedAttacher:
    """Groups the attaches asked in one moment into ``attach_many`` requests (at most
    ``ATTACH_MANY_MAX`` instances each), each on a new connection ``open_stream`` opens."""

    def __init__(self, open_stream: Callable[[list[list[Any]]], Awaitable[EventStream]],
                 detach: Callable[[str, str], Awaitable[Any]]) -> None:
        self._open_stream = open_stream
        self._detach = detach
        self._pending: list[_Pending] = []
        self._opening: set[asyncio.Task[None]] = set()
        self.shared: set[SharedStream] = set()

    async def attach(self, instance_id: str, after_seq: int) -> InstanceStream:
        """The instance's stream after ``after_seq``, shared with the attaches asked meanwhile."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[InstanceStream] = loop.create_future()
        self._pending.append((instance_id, after_seq, fut))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)  # after every consumer ready to run has asked
        return await fut

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        wanted: dict[str, _Pending] = {}
        for item in pending:
            if item[2].done():
                continue  # a cancelled attach is not asked for
            if item[0] in wanted:  # asked twice at once: the second goes out next, and replaces the first
                self._pending.append(item)
            else:
                wanted[item[0]] = item
        if self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        group = list(wanted.values())
        for start in range(0, len(group), ATTACH_MANY_MAX):
            task = asyncio.get_running_loop().create_task(self._open(group[start:start + ATTACH_MANY_MAX]))
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)

    async def _open(self, group: list[_Pending]) -> None:
        try:
            stream = await self._open_stream([[iid, after_seq] for iid, after_seq, _ in group])
            shared = SharedStream(stream, self._detach)
        except BaseException as exc:
            for _, _, fut in group:
                if fut.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    fut.cancel()
                else:
                    fut.set_exception(exc.copy() if isinstance(exc, IpcError) else exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.shared.add(shared)
        shared.on_done(lambda: self.shared.discard(shared))
        for iid, _, fut in group:
            target = shared.streams.get(iid)
            if fut.done():  # the asker was cancelled meanwhile
                if target is not None:
                    target.stop_reading()
            elif target is None:
                fut.set_exception(IpcError(ErrorCode.NOT_FOUND, f"no instance {iid!r}"))
            else:
                fut.set_result(target)

    async def close(self) -> None:
        """Close every shared connection (the client is closing)."""
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
        await asyncio.gather(*(s.close() for s in list(self.shared)), return_exceptions=True)
