"""The detached retention bound of the control server's event log (AC-EXECUTORS-SURVIVAL-001.5,
AC-EXECUTORS-SURVIVAL-001.6, AC-EXECUTORS-SURVIVAL-001.9, AC-EXECUTORS-SURVIVAL-001.10; docs/architecture.md#the-control-server-inside), in-process.

The log never drops: ``append`` always retains; the bound parks the producer in
``wait_for_room`` instead. The closed list of covered event classes is code
(``RETAINED_KINDS`` / ``EXCLUDED_KINDS``) and each class has its own test here.
The last tests put the real ``AgentPipeTransport`` on a real OS pipe, so that a
parked producer is shown to leave the writer blocked on the pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from daemon.agentctl.instance import pipe as agent_pipe
from daemon.agentctl.instance import pipe_internals
from daemon.agentctl.instance.events import EXCLUDED_KINDS, RETAINED_KINDS, EventLog
from daemon.agentctl.instance.pipe import AGENT_STDOUT_LIMIT, AgentPipeTransport
from daemon.agentctl.protocol import EventKind
from tests.support.aio import run
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(60)


def all_kinds() -> set[str]:
    return {v for k, v in vars(EventKind).items() if k.isupper() and isinstance(v, str)}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---------------------------------------------------------------- the closed list


def test_closed_list_covers_every_event_kind_and_excludes_none():
    """docs/architecture.md#the-control-server-inside: every kind is classified, exactly once; there are no MCP-attachment
    events in this project, so the excluded list is empty."""
    assert EXCLUDED_KINDS == ()
    assert len(set(RETAINED_KINDS)) == len(RETAINED_KINDS)
    assert set(RETAINED_KINDS) | set(EXCLUDED_KINDS) == all_kinds()
    assert not set(RETAINED_KINDS) & set(EXCLUDED_KINDS)


SAMPLE_DATA: dict[str, dict[str, Any]] = {
    EventKind.SESSION_UPDATE: {"turn_id": "t:1", "update": {"sessionUpdate": "agent_message_chunk"}},
    EventKind.AGENT_ERROR: {"message": "the agent wrote a line that is not JSON-RPC: junk"},
    EventKind.AGENT_EXITED: {"exit_code": 3, "stderr_tail": "boom"},
    EventKind.PERMISSION_REQUEST: {"request_id": "r1", "turn_id": "t:1", "tool_call": {}, "options": []},
    EventKind.PERMISSION_CANCELLED: {"request_id": "r1", "turn_id": "t:1", "reason": "cancel"},
    EventKind.TURN_STARTED: {"turn_id": "t:1", "text": "hi"},
    EventKind.TURN_ENDED: {"turn_id": "t:1", "stop_reason": "end_turn", "error": None},
}


def test_every_retained_kind_has_a_sample():
    assert set(SAMPLE_DATA) == set(RETAINED_KINDS)


@pytest.mark.parametrize("kind", RETAINED_KINDS)
def test_class_is_retained_at_the_bound_and_handed_over(kind: str):
    """AC-EXECUTORS-SURVIVAL-001.6, one test per class: at the bound the class is neither dropped
    nor refused; the producer parks instead, and an attach hands everything over in order."""

    async def scenario() -> None:
        log = EventLog(limit=3)
        log.append(EventKind.TURN_STARTED, {"turn_id": "t:1", "text": "x"})
        log.append(EventKind.SESSION_UPDATE, {"turn_id": "t:1", "update": {}})
        assert log.has_room
        first = log.append(kind, SAMPLE_DATA[kind])  # reaches the bound
        assert first is not None and log.retained_count == 3 and not log.has_room
        producer = asyncio.ensure_future(log.wait_for_room())
        await settle()
        assert not producer.done() and log.paused
        # a server-originated append at the bound is kept as well
        second = log.append(kind, SAMPLE_DATA[kind])
        assert second is not None and log.retained_count == 4
        sub = log.subscribe(0)
        await settle()
        assert producer.done() and not log.paused
        got = [await sub.next() for _ in range(4)]
        assert [e.seq for e in got] == [1, 2, 3, 4]
        assert [e.kind for e in got][2:] == [kind, kind]
        assert got[2].data == SAMPLE_DATA[kind]

    run(scenario())


# ---------------------------------------------------------------- the pause rule


def test_no_bound_until_armed_then_parks_at_the_limit():
    """The handshake runs unbounded (limit None); arming applies the limit to what is retained."""

    async def scenario() -> None:
        log = EventLog()
        for i in range(10):
            log.append(EventKind.SESSION_UPDATE, {"i": i})
        assert log.has_room
        await asyncio.wait_for(log.wait_for_room(), 1)
        log.set_limit(5)
        assert not log.has_room
        log.set_limit(None)
        assert log.has_room
        with pytest.raises(ValueError):
            log.set_limit(0)

    run(scenario())


def test_attached_never_parks_and_detaching_at_the_bound_does():
    """AC-EXECUTORS-SURVIVAL-001.9: decided by this log's own stream; attached, retention is 'until acked' and unbounded."""

    async def scenario() -> None:
        log = EventLog(limit=2)
        sub = log.subscribe(0)
        assert log.attached
        for i in range(50):
            log.append(EventKind.SESSION_UPDATE, {"i": i})
            assert log.has_room
        await asyncio.wait_for(log.wait_for_room(), 1)
        log.unsubscribe(sub)
        assert not log.attached and not log.has_room
        producer = asyncio.ensure_future(log.wait_for_room())
        await settle()
        assert log.paused
        log.discard_through(49)  # an ack that leaves 1 < 2 retained
        await settle()
        assert producer.done() and not log.paused and log.retained_count == 1

    run(scenario())


def test_acks_release_only_below_the_limit():
    async def scenario() -> None:
        log = EventLog(limit=3)
        for i in range(5):
            log.append(EventKind.SESSION_UPDATE, {"i": i})
        producer = asyncio.ensure_future(log.wait_for_room())
        await settle()
        log.discard_through(2)  # 2 discarded, 3 left: still full
        await settle()
        assert not producer.done() and log.paused
        log.discard_through(3)
        await settle()
        assert producer.done()

    run(scenario())


def test_close_releases_every_parked_producer_at_once_and_discards():
    """AC-EXECUTORS-SURVIVAL-001.10: stop releases all parked producers in one step and throws retained events away;
    later appends are no-ops and nothing parks any more."""

    async def scenario() -> None:
        log = EventLog(limit=1)
        log.append(EventKind.SESSION_UPDATE, {})
        producers = [asyncio.ensure_future(log.wait_for_room()) for _ in range(5)]
        await settle()
        assert log.paused and not any(p.done() for p in producers)
        log.close()
        await settle()
        assert all(p.done() for p in producers) and not log.paused
        assert log.retained_count == 0 and log.closed
        assert log.append(EventKind.AGENT_EXITED, {"exit_code": 0}) is None
        await asyncio.wait_for(log.wait_for_room(), 1)

    run(scenario())


def test_a_cancelled_producer_does_not_stay_counted_as_paused():
    async def scenario() -> None:
        log = EventLog(limit=1)
        log.append(EventKind.SESSION_UPDATE, {})
        producer = asyncio.ensure_future(log.wait_for_room())
        await settle()
        assert log.paused
        producer.cancel()
        await settle()
        assert not log.paused

    run(scenario())


# ---------------------------------------------------------------- the transport on a real pipe


class PipeAgent:
    """A fake agent: a thread writing lines into a real pipe, blocking when the pipe is full."""

    def __init__(self, lines: list[bytes]) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.lines = lines
        self.written = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        try:
            with os.fdopen(self.write_fd, "wb", buffering=0) as out:
                for line in self.lines:
                    view = memoryview(line)
                    while view:
                        n = out.write(view)
                        view = view[n:]
                    self.written += 1
        except (BrokenPipeError, OSError):
            pass
        finally:
            self.done.set()


async def open_transport(
    agent: PipeAgent, log: EventLog, on_update: Any = None, **kw: Any
) -> tuple[AgentPipeTransport, list[Any]]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=AGENT_STDOUT_LIMIT, loop=loop)
    read_transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(agent.read_fd, "rb", buffering=0)
    )
    # stdin side: a pipe nobody reads; receive() never writes
    stdin_r, stdin_w = os.pipe()
    write_transport, write_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(stdin_w, "wb", buffering=0)
    )
    writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)

    def garbage(line: str) -> None:
        log.append(EventKind.AGENT_ERROR, {"message": f"the agent wrote a line that is not JSON-RPC: {line}"})

    transport = AgentPipeTransport(reader, writer, garbage, log, on_update, **kw)
    return transport, [read_transport, write_transport, stdin_r]


def close_transport(closers: list[Any]) -> None:
    """Close what ``open_transport`` opened: the pipe transports and the stdin pipe's read end."""
    for c in closers:
        if isinstance(c, int):
            os.close(c)
        else:
            c.close()


async def pump(transport: AgentPipeTransport, log: EventLog) -> None:
    """What the SDK's receive loop plus the instance's observer do: one event per message."""
    while True:
        message = await transport.receive()
        if message is None:
            return
        log.append(EventKind.SESSION_UPDATE, {"update": message})


def test_parked_transport_blocks_the_writer_and_drops_nothing():
    """AC-EXECUTORS-SURVIVAL-001.6 at the transport: parked, the server stops reading, the writer blocks on the full pipe
    (it has not written everything), nothing is dropped; agent_error lines (the one class only the
    transport produces) included; after an attach all arrive exactly once, in order."""
    n = 20000
    lines: list[bytes] = []
    for i in range(1, n + 1):
        if i % 1000 == 0:
            lines.append(f"garbage {i}\n".encode())
        else:
            lines.append(json.dumps({"jsonrpc": "2.0", "method": "x", "params": {"i": i, "pad": "p" * 150}}).encode()
                         + b"\n")
    agent = PipeAgent(lines)

    async def scenario() -> None:
        log = EventLog(limit=100)
        transport, closers = await open_transport(agent, log)
        agent.thread.start()
        task = asyncio.ensure_future(pump(transport, log))
        try:
            await eventually(lambda: log.paused, 10, interval=0.01, message="the producer parked")
            await asyncio.sleep(0.5)
            assert log.paused and log.retained_count == 100
            written = agent.written
            await asyncio.sleep(0.5)
            assert agent.written == written < n and not agent.done.is_set(), "the writer is not blocked"
            sub = log.subscribe(0)
            got = []
            while len(got) < n:
                event = await asyncio.wait_for(sub.next(), 10)
                assert event is not None
                got.append(event)
                log.discard_through(event.seq)  # the backend acks as it applies
            await asyncio.wait_for(task, 10)
            assert transport.eof.is_set() and transport.drained
            assert [e.seq for e in got] == list(range(1, n + 1))
            for i, event in enumerate(got, start=1):
                if i % 1000 == 0:
                    assert event.kind == EventKind.AGENT_ERROR and f"garbage {i}" in event.data["message"]
                else:
                    assert event.kind == EventKind.SESSION_UPDATE and event.data["update"]["params"]["i"] == i
        finally:
            task.cancel()
            close_transport(closers)

    run(scenario())
    agent.thread.join(5)


def test_lines_longer_than_the_reader_limit_arrive_whole():
    """AGENT_STDOUT_LIMIT bounds what is buffered, not the size of a message."""
    big = json.dumps({"jsonrpc": "2.0", "method": "x", "params": {"blob": "b" * (3 * 1024 * 1024)}}).encode() + b"\n"
    small = json.dumps({"jsonrpc": "2.0", "method": "y"}).encode() + b"\n"
    agent = PipeAgent([big, small, big])

    async def scenario() -> None:
        log = EventLog(limit=1)
        transport, closers = await open_transport(agent, log)
        agent.thread.start()
        sub = log.subscribe(0)
        try:
            await asyncio.wait_for(pump(transport, log), 20)
            got = [await sub.next() for _ in range(3)]
            sizes = [len(e.data["update"].get("params", {}).get("blob", "")) for e in got]
            assert sizes == [3 * 1024 * 1024, 0, 3 * 1024 * 1024]
        finally:
            close_transport(closers)

    run(scenario())
    agent.thread.join(5)


def test_session_updates_go_to_on_update_in_their_place_and_the_rest_to_the_connection():
    """The transport hands ``session/update`` notifications to ``on_update`` (the instance records
    them) and returns every other message (the SDK's connection gets those): one stream, one order.
    A ``session/update`` that carries an id is a request, not a notification: the connection's."""
    def line(message: dict[str, Any]) -> bytes:
        return json.dumps({"jsonrpc": "2.0", **message}).encode() + b"\n"

    lines = [
        line({"method": "session/update", "params": {"update": {"n": 1}}}),
        line({"id": 7, "result": {}}),
        line({"method": "session/update", "params": {"update": {"n": 2}}}),
        line({"method": "session/update", "params": {"update": {"n": 3}}}),
        line({"id": "x", "method": "session/update", "params": {}}),
        line({"method": "session/update", "params": {"update": {"n": 4}}}),
    ]
    agent = PipeAgent(lines)
    seen: list[str] = []

    async def scenario() -> None:
        log = EventLog(limit=100)
        transport, closers = await open_transport(
            agent, log, on_update=lambda m: seen.append(f"update {m['params']['update']['n']}"))
        agent.thread.start()
        try:
            while (message := await asyncio.wait_for(transport.receive(), 10)) is not None:
                seen.append(f"connection {message['id']}")
        finally:
            close_transport(closers)

    run(scenario())
    agent.thread.join(5)
    assert seen == ["update 1", "connection 7", "update 2", "update 3", "connection x", "update 4"]


def test_a_line_longer_than_max_line_is_dropped_and_reported_and_reading_goes_on():
    """One agent cannot make the server hold an endless line: past ``max_line`` the rest of it is
    read and dropped, the line is one agent_error with its head and its length, and the messages
    around it arrive in order."""
    max_line = 256 * 1024
    huge = b'{"jsonrpc":"2.0","method":"session/update","params":{"pad":"' + b"p" * (20 * max_line) + b'"}}\n'
    at_eof = b"z" * (3 * max_line)  # the last line, cut and never ended by a newline
    lines = [json.dumps({"jsonrpc": "2.0", "method": "x", "params": {"i": 1}}).encode() + b"\n", huge,
             b"\n", json.dumps({"jsonrpc": "2.0", "method": "x", "params": {"i": 2}}).encode() + b"\n", at_eof]
    agent = PipeAgent(lines)

    async def scenario() -> list[Any]:
        log = EventLog(limit=100)
        transport, closers = await open_transport(agent, log, max_line=max_line)
        agent.thread.start()
        sub = log.subscribe(0)
        try:
            while (message := await asyncio.wait_for(transport.receive(), 10)) is not None:
                log.append(EventKind.SESSION_UPDATE, {"update": message})
            return [e for e in sub.ready(10)]
        finally:
            close_transport(closers)

    events = run(scenario())
    agent.thread.join(5)
    assert [e.kind for e in events] == [EventKind.SESSION_UPDATE, EventKind.AGENT_ERROR, EventKind.SESSION_UPDATE,
                                        EventKind.AGENT_ERROR]
    assert events[0].data["update"]["params"] == {"i": 1} and events[2].data["update"]["params"] == {"i": 2}
    first, last = events[1].data["message"], events[3].data["message"]
    assert first.startswith('the agent wrote a line that is not JSON-RPC: {"jsonrpc":"2.0","method":"session/update"')
    assert f"({len(huge) - 1} bytes, longer than the {max_line} a message may be: dropped)" in first
    assert f"({len(at_eof)} bytes, longer than" in last and len(first) < 400


def test_what_a_hand_over_gets_is_every_byte_not_handed_over_in_order():
    """Lines are taken from the reader in bursts (``pipe_internals.take_lines``), so after a few
    messages the transport holds lines the connection has not seen: ``unread`` (what a re-exec
    hands over) is exactly the rest of the agent's output, byte for byte, empty lines and an
    unterminated last line included."""
    lines = [json.dumps({"jsonrpc": "2.0", "id": i, "result": {"pad": "x" * (i % 7)}}).encode() + b"\n"
             for i in range(40)]
    lines[10:10] = [b"\n", b"  \n"]  # blank lines: skipped by receive(), still part of the bytes
    tail = b'{"jsonrpc": "2.0", "id": 99'  # no newline yet
    agent = PipeAgent([*lines, tail])

    async def scenario() -> tuple[list[Any], bytes, int]:
        log = EventLog(limit=100)
        transport, closers = await open_transport(agent, log)
        agent.thread.start()
        await asyncio.to_thread(agent.done.wait, 10)
        try:
            got = [(await asyncio.wait_for(transport.receive(), 10))["id"] for _ in range(3)]
            reader = transport._reader
            held_back = len(transport._lines)
            return got, transport.unread(pipe_internals.buffered_bytes(reader)), held_back
        finally:
            close_transport(closers)

    got, unread, held_back = run(scenario())
    assert got == [0, 1, 2]
    assert held_back > 0  # the burst was taken at once: the rest waits in the transport
    assert unread == b"".join(lines[3:]) + tail


def _rpc_line(i: int) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": i, "result": {}}).encode() + b"\n"


@contextlib.asynccontextmanager
async def _written_by_the_test(agent: PipeAgent) -> AsyncIterator[AgentPipeTransport]:
    """The transport on ``agent``'s pipe, whose lines the test writes itself (the agent's writer
    thread is not started); its write end is closed afterwards."""
    transport, closers = await open_transport(agent, EventLog())
    try:
        yield transport
    finally:
        close_transport(closers)
        os.close(agent.write_fd)


def test_before_a_read_that_has_to_wait_the_pipe_is_left_alone_so_that_a_burst_gathers(monkeypatch):
    """A streaming agent is read in bursts, not a line per event-loop turn: before a read that has
    to wait for the agent, the pipe is paused for ``READ_GATHER_S`` (lengthened here so that the
    test sees it), and what the agent writes meanwhile is then taken in one read."""
    monkeypatch.setattr(agent_pipe, "READ_GATHER_S", 0.3)
    agent = PipeAgent([])

    async def scenario() -> None:
        async with _written_by_the_test(agent) as transport:
            os.write(agent.write_fd, _rpc_line(0))
            assert (await asyncio.wait_for(transport.receive(), 10))["id"] == 0
            following = asyncio.ensure_future(transport.receive())
            await settle()
            for i in range(1, 21):  # a burst, one write per message as an agent writes them
                os.write(agent.write_fd, _rpc_line(i))
            await settle()
            # The pipe is not read while gathering: nothing came in, and the receive still waits.
            assert not following.done()
            assert pipe_internals.buffered_bytes(transport._reader) == b"" and not transport._lines
            assert (await asyncio.wait_for(following, 10))["id"] == 1
            assert len(transport._lines) == 19  # the rest came with it, in one read

    run(scenario())


def test_a_hand_over_that_stops_reading_during_a_gather_owns_the_pause_and_nothing_is_read(monkeypatch):
    """A reload stops reading the agent (``stop_reading_pipe``) and cancels the receive loop. If
    that loop was gathering, the pause becomes the hand-over's: the cancelled gather does not
    resume the pipe (bytes read after the capture would be lost), and only the hand-over's
    ``resume_pipe`` (a refused reload) reads again, from where it stopped."""
    monkeypatch.setattr(agent_pipe, "READ_GATHER_S", 0.3)
    agent = PipeAgent([])

    async def scenario() -> None:
        async with _written_by_the_test(agent) as transport:
            reader = transport._reader
            receiving = asyncio.ensure_future(transport.receive())
            await settle()  # gathering: the pipe is paused
            assert transport.stop_reading_pipe() is True
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiving
            os.write(agent.write_fd, _rpc_line(7))
            await settle()
            assert pipe_internals.buffered_bytes(reader) == b""
            assert transport.unread(pipe_internals.buffered_bytes(reader)) == b""  # the line waits in the pipe
            pipe_internals.resume_pipe(reader)  # the reload was refused: read again
            assert (await asyncio.wait_for(transport.receive(), 10))["id"] == 7

    run(scenario())
