"""Collecting what streams deliver: a process's output with arrival times, the control server's
event streams, and the transcript of ``kandev session show``.

``TimedOutput`` reads one pipe of a running process (e.g. ``kandev follow``) in a thread and
records when each piece arrived. ``collect_until`` reads an ``EventStream`` until an awaited event;
``chunks`` and ``agent_chunks`` pick the agent's message text out of events and of a session's
transcript; ``wait_outcome`` polls a turn's outcome from ``turn_status``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.protocol import EventKind
from ipc.client import Event, EventStream
from tests.support.agentctl import STEP
from tests.support.waiting import eventually, wait_until


class TimedOutput:
    """Collects what a process writes to one pipe, with the monotonic time each piece arrived."""

    def __init__(self, pipe: Any) -> None:
        self.pieces: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: Any) -> None:
        fd = pipe.fileno()
        while data := os.read(fd, 65536):
            with self._lock:
                self.pieces.append((time.monotonic(), data))

    @property
    def text(self) -> str:
        with self._lock:
            return b"".join(d for _, d in self.pieces).decode(errors="replace")

    def arrival(self, needle: str) -> float | None:
        """When ``needle`` was first complete in the output (None: not yet)."""
        with self._lock:
            buf = b""
            for at, data in self.pieces:
                buf += data
                if needle.encode() in buf:
                    return at
        return None

    def wait_for(self, needle: str, timeout: float) -> float:
        return wait_until(lambda: self.arrival(needle), timeout=timeout, message=f"output shows {needle!r}")

    def join(self, timeout: float = 10) -> None:
        self._thread.join(timeout)


def sequence_problem(seen: list[str], expected: list[str]) -> str | None:
    """What is wrong with ``seen`` as a delivery of ``expected`` (every item once, in order), in one
    line a person can read: its length, the first place it departs, what is missing or repeated.
    None when it is exactly ``expected``. (A long stream's list diff is pages of numbers.)"""
    if seen == expected:
        return None
    at = next((i for i, (a, b) in enumerate(zip(seen, expected, strict=False)) if a != b),
              min(len(seen), len(expected)))
    counts: dict[str, int] = {}
    for item in seen:
        counts[item] = counts.get(item, 0) + 1
    repeated = [item for item, n in counts.items() if n > 1]
    missing = [item for item in expected if item not in counts]
    lo = max(0, at - 2)
    got = seen[lo:at + 3] if at < len(seen) else "the end"
    return (f"{len(seen)} items for {len(expected)}; first departure at index {at}: "
            f"{got} where {expected[lo:at + 3]} was expected; "
            f"{len(repeated)} repeated (first {repeated[:5]}), {len(missing)} missing (first {missing[:5]})")


def agent_chunks(show: dict[str, Any]) -> list[str]:
    """The agent's message chunks in a ``session show`` transcript, in order."""
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


async def collect_until(stream: EventStream, stop: Callable[[Event], bool], timeout: float = STEP) -> list[Event]:
    """Read events until ``stop(event)`` is true (that event included)."""
    events: list[Event] = []

    async def read() -> None:
        async for event in stream:
            events.append(event)
            if stop(event):
                return
        raise AssertionError(f"stream ended before the awaited event; got {events[-3:]}")

    await asyncio.wait_for(read(), timeout)
    return events


def chunks(events: list[Event]) -> list[str]:
    """The text of the agent's message chunks among control-server events, in order."""
    return [
        e.data["update"]["content"]["text"]
        for e in events
        if e.kind == EventKind.SESSION_UPDATE and e.data["update"].get("sessionUpdate") == "agent_message_chunk"
    ]


def turn_ended(turn_id: str) -> Callable[[Event], bool]:
    """A ``collect_until`` stop condition: the ``turn_ended`` event of ``turn_id``."""
    return lambda e: e.kind == EventKind.TURN_ENDED and e.data["turn_id"] == turn_id


async def wait_outcome(client: AgentctlClient, instance_id: str, turn_id: str) -> dict[str, Any]:
    """Poll ``turn_status`` until it reports the outcome of ``turn_id`` (``2 * STEP`` at most)."""

    async def outcome() -> dict[str, Any] | None:
        status = await client.turn_status(instance_id)
        return next((o for o in status["outcomes"] if o["turn_id"] == turn_id), None)

    return await eventually(outcome, STEP * 2, message=f"the outcome of turn {turn_id}")


async def instance_entry(client: AgentctlClient, instance_id: str) -> dict[str, Any]:
    """The control server's listing of one instance; an instance that is not listed fails."""
    for entry in await client.list_instances():
        if entry["instance_id"] == instance_id:
            return entry
    raise AssertionError(f"instance {instance_id} is not listed")


async def wait_instance(
    client: AgentctlClient, instance_id: str, predicate: Callable[[dict[str, Any]], Any], timeout: float = STEP,
    what: str = "matching",
) -> dict[str, Any]:
    """The listing of ``instance_id`` once ``predicate`` holds for it (``timeout`` at most; an
    instance that is not listed fails at once)."""
    seen: list[dict[str, Any]] = []

    async def matching() -> dict[str, Any] | None:
        entry = await instance_entry(client, instance_id)
        seen[:] = [entry]
        return entry if predicate(entry) else None

    try:
        return await eventually(matching, timeout, message=f"instance {instance_id} {what}")
    except TimeoutError as exc:  # say what the listing said last, not just that it did not match
        raise TimeoutError(f"{exc}; last listed as {seen[0] if seen else None}") from None
