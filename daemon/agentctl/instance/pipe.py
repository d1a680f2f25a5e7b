"""The agent's pipes as an ACP message transport: the output path's first step and its brake.

``AgentPipeTransport`` owns the framing of the agent's stdin/stdout (newline-delimited JSON, the
SDK's framing), the requests of ours still awaiting an answer (``requests_sent``), what was read
and not handed over (a line held back, the pieces of a long one: nothing is lost by a cancel or
a re-exec) and the place where reading pauses for backpressure: the detached bound of
``daemon.agentctl.instance.events.EventLog`` is awaited before each message is handed over, so a full
detached log leaves the agent blocked in its own write (AC-EXECUTORS-SURVIVAL-001.6).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from daemon.agentctl.instance import agent_json, pipe_internals

log = logging.getLogger("kandev.agentctl.instance")

AGENT_STDOUT_LIMIT = 64 * 1024
"""``StreamReader`` limit of the agent's stdout: it stops reading the pipe at about twice this, so
a parked producer leaves the agent blocked instead of buffering its output in the server. Longer
lines still work (``AgentPipeTransport._read_line`` reads them in pieces)."""

MAX_LINE_BYTES = 16 * 1024 * 1024
"""The longest line (one message) taken from an agent; the rest of a longer one is read and
dropped, and the line reported as an ``agent_error`` with its first bytes. Twice what one event
may carry (``events.MAX_EVENT_BYTES``; a larger update is sent as a size marker anyway), so it
bounds the server's memory per agent without losing anything an event could hold."""

_HEAD_BYTES = 200  # of a line reported as garbage

READ_GATHER_S = 0.001
"""How long the agent's pipe is left alone before each read that has to wait for it: what the
agent writes meanwhile gathers in the pipe (64 KiB, about 300 chunks of a streaming agent; one that
writes more blocks in its write for the rest of the millisecond) and one read then takes all of it.
Read at once instead, a streaming agent was read a line or two per event-loop turn, and those
turns (a wake-up, an ``epoll_wait``, a ``read``, the coroutine's resumption) were a third of the
control server's CPU per streamed chunk. It delays a message by at most this much."""


class Gate(Protocol):
    """Where reading pauses for backpressure (``daemon.agentctl.instance.events.EventLog``)."""

    @property
    def has_room(self) -> bool: ...

    async def wait_for_room(self) -> None: ...


class AgentPipeTransport:
    """An ``acp`` message transport over the agent's stdin/stdout (newline-delimited JSON).

    Same framing as the SDK's stdio transport; owning it gives the server
    two things: ``eof`` (every line the agent wrote has been handed to the
    connection) and the place where reading pauses for backpressure
    (AC-EXECUTORS-SURVIVAL-001.6, docs/architecture.md#processes): before each message read is
    handed over, ``gate.wait_for_room()`` is awaited (the ``EventLog``) unless ``gate.has_room``
    says there is room already; the next ``receive()`` is not even called meanwhile, so nothing
    more is read. No lock is held while it waits.

    A line is taken with ``readuntil``, and with it every other complete line the reader already
    holds (``pipe_internals.take_lines``, kept in ``_lines``): one coroutine call for a burst of
    lines, not one per line.

    ``session/update`` notifications, nearly all of what an agent writes while it works, go to
    ``on_update`` (when given) in their place in the stream and not to the connection: the SDK
    would deep-copy each for its observers, start a task for it and validate it with pydantic, only
    to call a client handler with nothing to do (the server records the raw message), which was
    about half of the control server's CPU per streamed chunk.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_garbage: Callable[[str], None] | None = None,
        gate: Gate | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
        max_line: int = MAX_LINE_BYTES,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._on_garbage = on_garbage
        self._gate = gate
        self._on_update = on_update
        # A line read but not handed over yet (held back by the gate, or the reading was stopped
        # for a re-exec) and the pieces of a long line already taken from the reader: both stay
        # here, never in a local variable, so cancelling receive() at any await loses nothing.
        self._held: bytes | None = None
        self._lines: deque[bytes] = deque()  # complete lines taken from the reader after _held
        self._partial: list[bytes] = []
        self._partial_size = 0
        # A line longer than max_line: the bytes dropped so far (its head stays in _partial), and
        # once it ended, its whole length (while its head is held).
        self._max_line = max_line
        self._dropped = 0
        self._held_cut: int | None = None
        self._gathering = False  # the pipe is paused by _gather (see stop_reading_pipe)
        self._send_lock = asyncio.Lock()
        self._sending = 0  # send() calls not yet returned
        self.requests_sent: dict[Any, str] = {}  # JSON-RPC id -> method, until its answer is read
        self.eof = asyncio.Event()

    @property
    def drained(self) -> bool:
        """Whether every message the agent wrote was handed over: ``eof``, or nothing is held back
        and the reader holds the end of the pipe and nothing else (also while parked)."""
        return self.eof.is_set() or (self._held is None and not self._lines and not self._partial
                                     and self._reader.at_eof())

    @property
    def writes_settled(self) -> bool:
        """No send in progress and nothing of ours waiting to go into the agent's stdin pipe."""
        transport = self._writer.transport
        return self._sending == 0 and (transport.is_closing() or transport.get_write_buffer_size() == 0)

    def unread(self, buffered: bytes) -> bytes:
        """Everything read from the agent and not handed over, in order, given the reader's buffer."""
        return (self._held or b"") + b"".join(self._lines) + b"".join(self._partial) + buffered

    async def send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        self._sending += 1
        try:
            async with self._send_lock:
                if self._writer.is_closing():
                    raise ConnectionResetError("the agent's stdin is closed")
                if "method" in message and "id" in message:
                    self.requests_sent[message["id"]] = str(message["method"])
                self._writer.write(data)
                await self._writer.drain()
        finally:
            self._sending -= 1

    async def receive(self) -> dict[str, Any] | None:
        try:
            while True:
                if self._held is None:
                    if self._lines:
                        self._held = self._lines.popleft()
                    else:
                        await self._gather()
                        line = await self._read_line()
                        if not line:
                            self.eof.set()
                            return None
                        self._held = line
                        if self._held_cut is None:
                            self._lines.extend(pipe_internals.take_lines(self._reader))
                line = self._held.strip()
                if not line and self._held_cut is None:
                    self._held = None
                    continue
                message: Any = None
                if self._held_cut is None:
                    try:
                        message = agent_json.decode(line)  # valid Unicode, at most MAX_DEPTH levels deep
                    except ValueError:  # UnicodeDecodeError included
                        pass
                if self._gate is not None and not self._gate.has_room:
                    # Parks, holding this one message back, while the detached bound is reached.
                    # Checked after the read (not before it) so that events the server appended
                    # while this read was waiting for the agent count too.
                    await self._gate.wait_for_room()
                self._held = None
                if isinstance(message, dict):
                    if self._on_update is not None and message.get("method") == "session/update" \
                            and "id" not in message:
                        self._on_update(message)
                        continue
                    if "method" not in message and "id" in message:
                        self.requests_sent.pop(message["id"], None)  # the answer to one of ours
                    return message
                said = line[:_HEAD_BYTES].decode("utf-8", errors="replace")
                if self._held_cut is not None:
                    said = (f"{said}... ({self._held_cut} bytes, longer than the {self._max_line} a message"
                            " may be: dropped)")
                    self._held_cut = None
                if self._on_garbage is not None:
                    self._on_garbage(said)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken pipe is the end of the conversation
            log.warning("reading the agent's stdout failed: %s", exc)
            self.eof.set()
            return None

    async def _gather(self) -> None:
        """Leave the pipe unread for ``READ_GATHER_S`` (a pipe someone else paused is left as it is)."""
        if not pipe_internals.pause_pipe(self._reader):
            return
        self._gathering = True
        try:
            await asyncio.sleep(READ_GATHER_S)
        finally:
            if self._gathering:  # not taken over by stop_reading_pipe meanwhile
                self._gathering = False
                pipe_internals.resume_pipe(self._reader)

    def stop_reading_pipe(self) -> bool:
        """Stop reading the agent's pipe (for a hand-over; what the agent writes meanwhile stays
        in the pipe). True if the caller owns the pause now and undoes it with
        ``pipe_internals.resume_pipe`` if it goes on reading: the pipe was being read, or only a
        gather had paused it (which then leaves it paused when its wait ends or is cancelled)."""
        if self._gathering:
            self._gathering = False
            return True
        return pipe_internals.pause_pipe(self._reader)

    async def _read_line(self) -> bytes:
        """The next line. One longer than ``max_line`` is read to its end but not kept: its head
        is returned and its whole length left in ``_held_cut``."""
        try:
            while True:
                try:
                    last = await self._reader.readuntil(b"\n")
                    break
                except asyncio.LimitOverrunError as exc:
                    # exc.consumed bytes are buffered already: this read never waits.
                    piece = await self._reader.readexactly(exc.consumed)
                    if self._dropped:
                        self._dropped += len(piece)
                        continue
                    self._partial.append(piece)
                    self._partial_size += len(piece)
                    if self._partial_size > self._max_line:
                        head = b"".join(self._partial)[:_HEAD_BYTES]
                        self._dropped = self._partial_size - len(head)
                        self._partial, self._partial_size = [head], len(head)
        except asyncio.IncompleteReadError as exc:
            last = exc.partial
        if self._dropped:
            line = self._partial[0]
            self._held_cut = len(line) + self._dropped + len(last) - last.endswith(b"\n")
            self._dropped = 0
        else:
            line = b"".join(self._partial) + last
        self._partial.clear()
        self._partial_size = 0
        return line

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()


async def wait_any(events: tuple[asyncio.Event, ...], timeout: float) -> None:
    """Return when one of ``events`` is set or after ``timeout`` s."""
    if any(e.is_set() for e in events):
        return
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def drain(transport: AgentPipeTransport, paused: Callable[[], bool], stop: asyncio.Event, grace: float) -> bool:
    """Wait until every line of an exited agent's stdout was read, ``stop``, or ``grace`` s of
    reading time (a child may hold stdout open); False if the grace ran out. Time the producer
    spends parked by the detached bound (``paused``) does not count: the rest is read after an
    attach."""
    loop = asyncio.get_running_loop()
    while not transport.drained and not stop.is_set():
        if grace <= 0:
            return False
        was_paused = paused()
        started = loop.time()
        await wait_any((transport.eof, stop), min(grace, 0.1) if not was_paused else 0.1)
        if not (was_paused and paused()):
            grace -= loop.time() - started
    return True
