"""One event stream for many instances: the ``attach_many`` op's loop (protocol 1.2).

``attach`` gives one instance's events a connection of their own, authenticated with its own
handshake. A backend that re-tracks a thousand agents after a restart would open a thousand; with
``attach_many`` it opens one. Each instance it names is attached exactly as ``attach`` attaches it
(events <= its ``after_seq`` discarded, a previous stream of it closed, the detached bound lifted
while attached), and the stream then carries every instance's events in frames tagged with the
instance: ``{instance, events: [[seq, kind, data], ...]}``, in seq order per instance.

When one instance's subscription ends (a newer ``attach`` of it, a ``detach``, the instance
stopping) the stream sends ``{instance, end: true}`` for it and goes on with the others; when
none is left the stream ends. Each round takes at most ``STREAM_BATCH`` events of every instance
that has some, so a flooding agent cannot hold back the others, and a write waits for the peer as
every stream write does (a slow backend slows the stream, and the agents' output is retained).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from daemon.agentctl.instance.events import Subscription
from daemon.agentctl.instance.instance import Instance
from daemon.agentctl.protocol import ATTACH_MANY_MAX
from ipc.codec_msgpack import encode_frame, event_batch_frames
from ipc.connection import EVENTS_PER_WRITE, ConnectionContext
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.agentctl.server")

STREAM_BATCH = 256  # events of one instance taken in one round (as ``attach`` takes for one send)


def wanted(raw: Any) -> list[tuple[str, int]]:
    """``attach_many``'s ``instances`` ([[instance_id, after_seq], ...]) checked: at most
    ``ATTACH_MANY_MAX``, each named once; else ``invalid_argument`` and nothing is attached."""
    if not isinstance(raw, list) or len(raw) > ATTACH_MANY_MAX:
        raise IpcError(ErrorCode.INVALID_ARGUMENT,
                       f"instances must be a list of at most {ATTACH_MANY_MAX} [instance_id, after_seq] pairs")
    pairs: list[tuple[str, int]] = []
    for item in raw:
        if (not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], int) or isinstance(item[1], bool) or item[1] < 0):
            raise IpcError(ErrorCode.INVALID_ARGUMENT,
                           "each of instances must be [instance_id (a string), after_seq (an integer >= 0)]")
        pairs.append((item[0], item[1]))
    if len({iid for iid, _ in pairs}) != len(pairs):
        raise IpcError(ErrorCode.INVALID_ARGUMENT, "instances names an instance more than once")
    return pairs


class ManyStreams:
    """The subscriptions of one ``attach_many`` stream and the instances that have events to send."""

    def __init__(self) -> None:
        self.subs: dict[str, tuple[Instance, Subscription]] = {}
        self.ready: dict[str, None] = {}  # instance ids with events or an end to send, in turn order
        self.wake = asyncio.Event()

    def attach(self, instances: list[tuple[Instance, int]]) -> None:
        """Attach every instance after its seq; all or none (a bad ``after_seq`` detaches the rest)."""
        try:
            for inst, after_seq in instances:
                sub = inst.attach(after_seq)
                self.subs[inst.instance_id] = (inst, sub)
                sub.listener = self._listener(inst.instance_id)
                self.ready[inst.instance_id] = None  # what is retained already goes first
        except BaseException:
            self.detach_all()
            raise
        self.wake.set()

    def _listener(self, instance_id: str) -> Any:
        def listener() -> None:
            self.ready[instance_id] = None
            self.wake.set()
        return listener

    def result(self, missing: list[str]) -> dict[str, Any]:
        return {
            "attached": {iid: {"next_seq": inst.log.next_seq, "retained_events": inst.log.retained_count,
                               "stream": sub.token} for iid, (inst, sub) in self.subs.items()},
            "missing": missing,
        }

    def take(self) -> list[bytes]:
        """The frames of one round: up to ``STREAM_BATCH`` events of each ready instance (and the
        end of each whose subscription ended), until about ``EVENTS_PER_WRITE`` bytes are taken;
        an instance with more left goes to the back of the turn order."""
        frames: list[bytes] = []
        size = 0
        for iid in list(self.ready):
            del self.ready[iid]
            inst, sub = self.subs[iid]
            events = sub.ready(STREAM_BATCH)
            if events:
                batch = event_batch_frames([e.wire() for e in events], EVENTS_PER_WRITE, tag=iid)
                frames.extend(batch)
                size += sum(len(f) for f in batch)
            if sub.closed:
                frames.append(encode_frame({"instance": iid, "end": True}))
                sub.listener = None
                inst.detach(sub)
                del self.subs[iid]
            elif len(events) == STREAM_BATCH:
                self.ready[iid] = None  # more may be retained: its next turn comes after the others'
            if size >= EVENTS_PER_WRITE:
                break
        return frames

    def detach_all(self) -> None:
        for inst, sub in self.subs.values():
            sub.listener = None
            inst.detach(sub)
        self.subs.clear()
        self.ready.clear()


async def serve(ctx: ConnectionContext, streams: ManyStreams, missing: list[str]) -> None:
    """Start the stream and send until no subscription is left (or the peer goes)."""
    try:
        await ctx.start_stream(streams.result(missing))
        while streams.subs:
            if not streams.ready:
                streams.wake.clear()
                await streams.wake.wait()
                continue
            frames = streams.take()
            if frames:
                await ctx.send_event_frames(frames)
    finally:
        streams.detach_all()
