"""The event-stream ops: what the backend reads back from an instance, attached or not.

- ``attach`` makes the connection the instance's one stream: events after ``after_seq`` are
  sent in order, in batches of what is already retained (``STREAM_BATCH``); a batch lost with
  the connection is sent again from the backend's ``after_seq`` on its next attach. A streaming
  agent's output is read in bursts (``agent_pipe.READ_GATHER_S``) and a burst is logged at once,
  so a busy stream wakes once per burst and sends it in one write; it never waits for more.
  Asked with ``batched`` (this release's backend), a stream puts the events of one write in one
  frame (``codec_msgpack.event_batch_frames``, up to ``EVENTS_PER_WRITE`` bytes each), so the
  backend decodes a burst in one call; without it (an older backend), one frame per event.
- ``attach_many`` attaches many instances on one connection, each as ``attach`` would, and
  tags each frame with its instance (``daemon.agentctl.api.attach_many``); ``detach`` ends one
  instance's stream, named by the token ``attach_many`` answered, and no newer one.
- ``ack_events`` discards retained events through a seq.
- ``turn_status`` / ``turn_statuses`` are pure reads of the open turn and the retained outcomes
  (AC-EXECUTORS-SURVIVAL-004.6); ``ack_turn`` discards one outcome (an unknown id is accepted
  and changes nothing).

The log itself and its detached bound are ``daemon.agentctl.instance.events``'; an instance's use of it
is ``daemon.agentctl.instance.instance``'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from daemon.agentctl.api import attach_many as many
from daemon.agentctl.protocol import TURN_STATUSES_MAX
from daemon.agentctl.server_context import ServerContext
from daemon.core import faults
from ipc import codec_msgpack
from ipc.codec_msgpack import event_batch_frames, event_frame
from ipc.connection import EVENTS_PER_WRITE, ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.framing import ConnectionClosed
from ipc.server import Handler

if TYPE_CHECKING:
    from daemon.agentctl.instance.instance import Instance

log = logging.getLogger("kandev.agentctl.server")

STREAM_BATCH = 256  # events an attach stream takes from the log for one send (bounded in bytes by the ipc layer)


def handlers(server: ServerContext) -> dict[str, Handler]:
    """The event-stream ops' handlers."""

    async def attach(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        inst = server.get(args["instance_id"])
        after_seq = args.get("after_seq", 0)
        batched = args.get("batched", False)
        sub = inst.attach(after_seq)
        log.debug("conn %d: attached to %s after seq %d", server.conn_id(ctx), inst.instance_id, after_seq)
        try:
            await ctx.start_stream(
                {
                    "instance_id": inst.instance_id,
                    "next_seq": inst.log.next_seq,
                    "retained_events": inst.log.retained_count,
                }
            )
            while True:
                event = await sub.next()
                if event is None:
                    break
                # What else is already retained goes in the same write (in order; a batch lost with
                # the connection is sent again from the backend's after_seq on its next attach).
                batch = [event, *sub.ready(STREAM_BATCH - 1)]
                if ctx.codec is codec_msgpack:  # (always, for a control server's connections)
                    packed = [e.wire() for e in batch]
                    await ctx.send_event_frames(event_batch_frames(packed, EVENTS_PER_WRITE) if batched
                                                else [event_frame(*p) for p in packed])
                else:
                    await ctx.send_events([(e.seq, e.kind, e.data) for e in batch])
        except ConnectionClosed:
            pass
        finally:
            inst.detach(sub)
            log.debug("conn %d: detached from %s", server.conn_id(ctx), inst.instance_id)

    async def attach_many(ctx: ConnectionContext, args: dict[str, Any]) -> None:
        pairs = many.wanted(args["instances"])
        found: list[tuple[Instance, int]] = []
        missing: list[str] = []
        for instance_id, after_seq in pairs:
            inst = server.find(instance_id)
            if inst is None:
                missing.append(instance_id)  # what attach answers with not_found
            else:
                found.append((inst, after_seq))
        streams = many.ManyStreams()
        streams.attach(found)
        log.debug("conn %d: attached to %d instances (%d missing)", server.conn_id(ctx), len(found), len(missing))
        try:
            await many.serve(ctx, streams, missing)
        except ConnectionClosed:
            pass
        finally:
            log.debug("conn %d: detached from its instances", server.conn_id(ctx))

    def detach(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        inst = server.find(args["instance_id"])
        return {"detached": inst is not None and inst.log.unsubscribe_token(args["stream"])}

    def ack_events(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        discarded = server.get(args["instance_id"]).ack_events(args["seq"])
        return {"discarded": discarded}

    def turn_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_turn_status_fails")  # test fault, off unless $KANDEV_FAULT says so
        return server.get(args["instance_id"]).turn_status()

    async def turn_statuses(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_turn_status_fails")  # the same test fault as one turn_status read
        await faults.delay("agentctl_slow_turn_statuses")  # answered as the instances are after the delay
        ids = args["instance_ids"]
        if len(ids) > TURN_STATUSES_MAX or not all(isinstance(i, str) for i in ids):
            raise IpcError(ErrorCode.INVALID_ARGUMENT,
                           f"instance_ids must be at most {TURN_STATUSES_MAX} instance ids (strings)")
        statuses: dict[str, Any] = {}
        missing: list[str] = []
        for instance_id in ids:
            inst = server.find(instance_id)
            if inst is None:
                missing.append(instance_id)
            else:
                statuses[instance_id] = inst.turn_status()
        return {"statuses": statuses, "missing": missing}

    def ack_turn(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        turn_id = args["turn_id"]
        for inst in server.instances.values():
            if inst.ack_turn(turn_id):
                return {"acked": True}
        return {"acked": False}  # unknown id: accepted, nothing changes (AC-EXECUTORS-SURVIVAL-004.6)

    return {
        "attach": attach, "attach_many": attach_many, "detach": detach, "ack_events": ack_events,
        "turn_status": turn_status, "turn_statuses": turn_statuses, "ack_turn": ack_turn,
    }
