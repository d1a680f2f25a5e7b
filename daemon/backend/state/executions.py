"""The backend's in-memory execution store: tracked sessions, guards, event consumers.

An *execution* is this backend's handle on one agent instance in the control
server: which session it serves, the instance id, the agent's identity (pid
and start, ``daemon.backend.state.agent_identity``), and the task that consumes its
event stream. The backend never holds a pipe or signals an agent itself; it
only talks to the control server.

Guards (AC-EXECUTORS-SURVIVAL-002.8): while startup recovery decides a
session, a launch for it is refused at once with a retryable
``session_guarded`` error. Taking a guard is one atomic acquire-or-observe
against the same map the launch path checks (single-threaded asyncio makes a
plain check-and-set atomic as long as no ``await`` sits between them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import OwnershipRefused
from daemon.agentctl.client.shared_streams import InstanceStream
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.events import apply_events, mark_agent_gone
from daemon.core.journal import log_event
from daemon.store.db import Store
from daemon.store.reach import ReachWatch
from daemon.store.space import SpaceWatch
from ipc.aio import cancel_and_wait
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

BATCH_MAX = 2000
BUSY_BATCH = 64
BUSY_GATHER_S = 0.005
"""After a batch of at least ``BUSY_BATCH`` events (a stream in full flow) the consumer waits this
long before it takes the next one. A transaction costs the backend about 0.45 ms of CPU whatever
it holds (its statements, the commit, the fsync's share, the ack), and a consumer that kept up with
a flood committed batches of about a hundred events: 4 of its 11-16 µs per chunk. After the wait a
batch holds a few hundred (in interleaved runs of ``/flood 100000``, 10-11 µs against 12-17 µs
per chunk). A stream at a person's pace never waits; a flood's last events wait at most this much."""
REATTACH_DELAY_S = 0.5
LOST_WARNING_EVERY_S = 30.0  # a stream that keeps failing is reported at most this often


@dataclass
class Execution:
    session_id: str
    task_id: str
    instance_id: str
    agent: AgentIdentity
    acp_session_id: str | None
    retracked: bool = False
    passthrough: bool = False  # runs on the backend's own child server; never survives
    last_seq: int = 0
    applied_turns: set[str] = field(default_factory=set)
    # Turns whose outcome recovery applied from turn_status before the events of their end were
    # replayed: their transcript is not complete until the consumer applies their turn_ended
    # event (a follow stream waits for that, daemon.backend.views.follow).
    replaying_turns: set[str] = field(default_factory=set)
    turn_waiters: dict[str, list[asyncio.Future[str | None]]] = field(default_factory=dict)
    consumer: asyncio.Task[None] | None = None
    gone: bool = False
    gone_reason: str | None = None  # the stop reason a late waiter gets once the execution is gone
    stream_failures: int = 0  # consecutive failed attaches, for rate-limited warnings
    warned_at: float | None = None

    def wait_turn(self, turn_id: str) -> asyncio.Future[str | None]:
        fut: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        if self.gone and self.gone_reason is not None:
            fut.set_result(self.gone_reason)  # nothing will ever end this turn here
            return fut
        self.turn_waiters.setdefault(turn_id, []).append(fut)
        return fut

    def resolve_turn(self, turn_id: str, stop_reason: str | None) -> None:
        for fut in self.turn_waiters.pop(turn_id, []):
            if not fut.done():
                fut.set_result(stop_reason)

    def fail_waiters(self, reason: str) -> None:
        for turn_id in list(self.turn_waiters):
            self.resolve_turn(turn_id, reason)

    def interrupt(self, reason: str) -> None:
        """Its control server is gone: nothing more comes from it; every waiter gets ``reason``."""
        self.gone = True
        self.gone_reason = reason
        self.fail_waiters(reason)


class Guarded(IpcError):
    pass


class GuardReason(StrEnum):
    """Why a session refuses launches (``ExecutionStore.check_launch``)."""

    RECOVERING = "recovering"  # startup recovery decides it (retryable)
    UNSTOPPED_AGENT = "unstopped_agent"  # an agent of it could not be stopped: until the next backend start


class ExecutionStore:
    """Tracked executions and recovery guards, keyed by session id."""

    def __init__(self) -> None:
        self.executions: dict[str, Execution] = {}
        self.guards: dict[str, GuardReason] = {}  # session_id -> why it is guarded
        self.holds: dict[str, int] = {}  # session_id -> stops in flight that keep its guard (AC-EXECUTORS-SURVIVAL-003.7)

    def acquire_guard(self, session_id: str) -> bool:
        """Guard a session unless it is already guarded or tracked (then only observe)."""
        if session_id in self.guards or session_id in self.executions:
            return False
        self.guards[session_id] = GuardReason.RECOVERING
        return True

    def release_guard(self, session_id: str) -> None:
        """Release a recovery guard, unless a stop for this session is still in flight."""
        if self.guards.get(session_id) == GuardReason.RECOVERING and not self.holds.get(session_id):
            del self.guards[session_id]

    def hold_guard(self, session_id: str) -> None:
        """A stop for this session is in flight: its guard outlives the deadline until the stop resolves."""
        self.guards.setdefault(session_id, GuardReason.RECOVERING)
        self.holds[session_id] = self.holds.get(session_id, 0) + 1

    def _unhold(self, session_id: str) -> None:
        left = self.holds.get(session_id, 0) - 1
        if left > 0:
            self.holds[session_id] = left
        else:
            self.holds.pop(session_id, None)

    def release_held_guard(self, session_id: str) -> None:
        self._unhold(session_id)
        self.release_guard(session_id)

    def mark_unstopped(self, session_id: str) -> None:
        """An agent of this session could not be stopped: guarded for the rest of this lifetime (AC-EXECUTORS-SURVIVAL-002.16)."""
        self._unhold(session_id)
        self.guards[session_id] = GuardReason.UNSTOPPED_AGENT

    async def drop(self, predicate: Callable[[Execution], bool], reason: str) -> list[Execution]:
        """Stop tracking every execution ``predicate`` picks (its control server is gone): untracked,
        its waiters answered with ``reason``, its event consumer stopped. Returns them."""
        dropped = [ex for ex in self.executions.values() if predicate(ex)]
        for ex in dropped:
            self.executions.pop(ex.session_id, None)
            ex.interrupt(reason)
        consumers = [ex.consumer for ex in dropped if ex.consumer is not None and ex.consumer is not asyncio.current_task()]
        stopped = await asyncio.gather(*(cancel_and_wait(t) for t in consumers))
        if not all(stopped):
            log.error("%d event consumer(s) did not stop within 5 s of being cancelled", stopped.count(False))
        return dropped

    def check_launch(self, session_id: str) -> None:
        """Refuse a launch for a guarded session (retryable while recovering)."""
        reason = self.guards.get(session_id)
        if reason == GuardReason.RECOVERING:
            raise IpcError("session_guarded", f"session {session_id} is being recovered; retry shortly", True)
        if reason == GuardReason.UNSTOPPED_AGENT:
            raise IpcError(
                "session_guarded",
                f"session {session_id} has an agent that could not be stopped; restart the backend",
                False,
            )


class StoreOutOfSpace(Exception):
    """A batch could not be committed for want of space (``daemon.store.space``)."""


class StoreUnreachable(Exception):
    """A batch could not be committed: the database server is unreachable (``daemon.store.reach``)."""


class EventConsumer:
    """Consumes one execution's event stream into the store, in seq order, in batches.

    Whatever the stream has delivered when a batch starts (up to ``BATCH_MAX`` events) is applied
    in one transaction and acknowledged with one ``ack_events`` once committed (Issue 24 item 6);
    after a busy batch the next one gathers for ``BUSY_GATHER_S`` first.
    A batch the store has no space for is rolled back whole and not acknowledged: the consumer
    closes (a shared stream: detaches) its stream, so the control server keeps the events and pauses the agent at its detached
    bound, exactly as with no backend attached; once space is back it re-attaches after the last
    committed seq and catches up, every event once and in order (Issue 21 item 5).
    A database server that cannot be reached is met the same way (Issue 47 item 5): the batch is
    not acknowledged, the stream is detached, and the consumer waits until the store's upkeep
    reaches the server again (``daemon.store.reach``); while that episode lasts no consumer tries
    the store (a connection attempt would hold the event loop). A commit whose answer was lost
    with the connection is no risk either: applying an event again is a no-op
    (``daemon.backend.state.events``), and its turn's end is reported again.
    """

    def __init__(
        self,
        store: Store,
        client_factory: Callable[[Execution], AgentctlClient | None],
        on_gone: Callable[[Execution], None],
        space: SpaceWatch | None = None,
        on_applied: Callable[[str, list[Any]], None] | None = None,
        reach: ReachWatch | None = None,
    ) -> None:
        self.store = store
        self.client_factory = client_factory
        self.on_gone = on_gone
        # told each committed batch of a session's events (how long its turn has been quiet)
        self.on_applied = on_applied
        self.space = space if space is not None else SpaceWatch(None)
        self.reach = reach if reach is not None else ReachWatch()
        self.stopping = False

    def start(self, ex: Execution) -> None:
        ex.consumer = asyncio.get_running_loop().create_task(self._run(ex), name=f"events-{ex.session_id}")

    async def _run(self, ex: Execution) -> None:
        while not self.stopping and not ex.gone:
            client = self.client_factory(ex)
            if client is None:
                return
            try:
                await self._consume_once(client, ex)
            except asyncio.CancelledError:
                raise
            except StoreOutOfSpace:
                # The stream is closed (detached): the control server holds the rest.
                await self.space.wait_for_space()
                continue
            except StoreUnreachable:
                await self.reach.wait_reachable()  # detached meanwhile, as above
                continue
            except OwnershipRefused as exc:
                log.warning("session %s: control server refused us (%s); no longer tracking it", ex.session_id, exc)
                ex.gone = True
                self.on_gone(ex)
                return
            except IpcError as exc:
                if exc.code == ErrorCode.SUPERSEDED_CREDENTIAL:
                    # Another backend adopted the server: these executions are no longer ours (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3).
                    log.warning("session %s: credential superseded; no longer tracking it", ex.session_id)
                    ex.gone = True
                    self.on_gone(ex)
                    return
                if exc.code == ErrorCode.NOT_FOUND:
                    log.warning("instance %s of session %s is gone", ex.instance_id, ex.session_id)
                    self._agent_gone(ex, "agent instance is gone from the control server")
                    return
                self._warn_lost(ex, exc)
            except Exception:
                log.exception("event consumer for session %s failed", ex.session_id)
            if self.stopping or ex.gone:
                return
            await asyncio.sleep(REATTACH_DELAY_S)

    @staticmethod
    def _warn_lost(ex: Execution, exc: IpcError) -> None:
        """One warning when a stream is lost, then at most one every ``LOST_WARNING_EVERY_S`` while
        re-attaching keeps failing (a dead control server is handled by its link, not here)."""
        ex.stream_failures += 1
        now = asyncio.get_running_loop().time()
        if ex.warned_at is not None and now - ex.warned_at < LOST_WARNING_EVERY_S:
            return
        ex.warned_at = now
        again = f" ({ex.stream_failures} failed attempts so far)" if ex.stream_failures > 1 else ""
        log.warning("event stream for session %s lost: %s%s", ex.session_id, exc, again)

    async def _consume_once(self, client: AgentctlClient, ex: Execution) -> None:
        # Consumers that attach in one moment (every re-tracked session after a recovery) share one
        # connection and one handshake (Issue 24 item 5).
        stream = await client.attach_shared(ex.instance_id, after_seq=ex.last_seq)
        ex.stream_failures = 0
        ex.warned_at = None
        try:
            while True:
                # What arrived with the next event, in one wake-up: stored in one transaction.
                batch = await stream.batch(BATCH_MAX)
                if not batch:
                    return  # the stream ended (a newer attach, or the server closed it)
                batch = [ev for ev in batch if ev.seq > ex.last_seq]
                if not batch:
                    continue
                if self.reach.unreachable:  # another store user found the server gone: no attempt
                    await self._detach(stream)
                    raise StoreUnreachable()
                try:
                    with self.store.session() as db:
                        result = apply_events(db, ex.session_id, ex.instance_id, batch)
                except Exception as exc:
                    if self.space.failed(exc):
                        await self._detach(stream)
                        raise StoreOutOfSpace() from exc
                    if self.reach.failed(exc):
                        await self._detach(stream)
                        raise StoreUnreachable() from exc
                    raise
                self.space.succeeded()
                ex.last_seq = batch[-1].seq
                if self.on_applied is not None:
                    self.on_applied(ex.session_id, batch)
                for turn_id, stop_reason in result.ended_turns:
                    ex.applied_turns.add(turn_id)
                    ex.replaying_turns.discard(turn_id)  # its entries are committed now
                    # Acked only now, after the outcome is durable, and never in the
                    # exchange that delivered it (AC-EXECUTORS-SURVIVAL-004.6).
                    with contextlib.suppress(IpcError):
                        await client.ack_turn(turn_id)
                    ex.resolve_turn(turn_id, stop_reason)
                with contextlib.suppress(IpcError):  # one ack per committed batch
                    await client.ack_events(ex.instance_id, ex.last_seq)
                if result.agent_exited:
                    self._agent_gone(ex, None)
                    with contextlib.suppress(IpcError):
                        await client.stop_instance(ex.instance_id)
                    return
                if len(batch) >= BUSY_BATCH:
                    await asyncio.sleep(BUSY_GATHER_S)  # let the flood's next batch gather
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    @staticmethod
    async def _detach(stream: Any) -> None:
        """Stop taking the stream's events (the control server keeps them from here)."""
        if isinstance(stream, InstanceStream):  # its connection goes on for the others
            await stream.detach()

    def _agent_gone(self, ex: Execution, reason: str | None) -> None:
        if reason is not None:
            with self.store.session() as db:
                mark_agent_gone(db, ex.session_id, reason)
        ex.gone = True
        ex.fail_waiters("agent_exited")
        log_event(
            "agent_gone",
            f"agent of session {ex.session_id} is gone",
            SESSION_ID=ex.session_id,
            TASK_ID=ex.task_id,
            INSTANCE_ID=ex.instance_id,
            REASON=reason or "agent_exited",
        )
        self.on_gone(ex)

    async def stop(self, executions: list[Execution]) -> None:
        """Stop consuming (backend shutdown); the instances keep running."""
        self.stopping = True
        tasks = [ex.consumer for ex in executions if ex.consumer is not None]
        stopped = await asyncio.gather(*(cancel_and_wait(t) for t in tasks))
        if not all(stopped):
            log.error("%d event consumer(s) did not stop within 5 s of being cancelled", stopped.count(False))
