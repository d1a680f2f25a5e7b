"""Startup recovery: adopt a surviving control server and re-track its agents.

Read ``Recovery.recover`` top to bottom: it is the ordered list of
docs/architecture.md#startup-recovery-step-by-step, one numbered block per step.

1. guards from the inventory, passthrough excluded, before any contact
2. read the control-server record; the first contact starts the deadline D
3. adoption gate: identify → credential → proof → authentication → capabilities → rotate/persist/confirm
4. enumerate → correlate by the server-held session id → per record: stop
   duplicates, check inputs, read turn outcome, apply, publish
5. at D every record without an outcome is not re-tracked and its instance stopped;
   work in flight (an adoption, a stop) finishes, is recorded, re-tracks nothing
6. one enumeration taken after every outcome; reconciliation classifies and repairs

With the capability disabled or unavailable there is no adoption and nothing is
reported recovered (AC-EXECUTORS-SURVIVAL-005.1); a provably-own survivor from an
earlier launch is stopped first (AC-EXECUTORS-SURVIVAL-005.5).

What a re-tracked record is rebuilt from is ``daemon.backend.recovery.reconstruction``; the repair path
reconciliation sends a dead session to is ``daemon.backend.recovery.repair``, which also serves a control
server that dies under a running backend (``repair_lost_server``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from daemon.agentctl.client.connection import AgentctlClient
from daemon.api.ops import AdoptionOutcome
from daemon.backend.recovery.adoption import Adopter, Adoption
from daemon.backend.recovery.batch import TurnStatusReader, WriteBatch
from daemon.backend.recovery.liveness import DEAD, Scope, classify
from daemon.backend.recovery.reconstruction import MissingInput, Record, reconstruct
from daemon.backend.recovery.repair import ACTIVE_STATES, iso_utc, repair_interrupted
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.state.events import (
    apply_turn_outcome,
    mark_replaying,
    mark_running,
    mark_waiting_without_turn,
)
from daemon.backend.state.executions import Execution, ExecutionStore
from daemon.core.journal import log_event
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord, ExecutorRunning, TaskSession
from daemon.store.states import InventoryStatus
from daemon.store.transcript import ensure_turn
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    retracked: list[str] = field(default_factory=list)
    not_retracked: dict[str, str] = field(default_factory=dict)  # session_id -> reason
    stopped_orphans: list[str] = field(default_factory=list)
    failed_stops: dict[str, str] = field(default_factory=dict)  # instance_id -> reason
    unknown: list[str] = field(default_factory=list)  # rows left untouched (liveness unknown)
    stopped_with_backend: list[str] = field(default_factory=list)  # agents the last backend stopped cleanly
    duration_ms: float = 0.0
    adoption: Adoption = field(default_factory=lambda: Adoption(AdoptionOutcome.DISABLED))


class Recovery:
    """One startup recovery run."""

    def __init__(
        self,
        store: Store,
        executions: ExecutionStore,
        adopter: Adopter,
        *,
        deadline_s: float,
        read_timeout_s: float,
        read_retries: int,
        boot_id: str,
    ) -> None:
        self.store = store
        self.executions = executions
        self.adopter = adopter
        self.deadline_s = deadline_s
        self.read_timeout_s = read_timeout_s
        self.read_retries = read_retries
        self.boot_id = boot_id
        self.past_deadline = False
        self.reconciled = False
        self.stops: dict[str, asyncio.Task[bool]] = {}  # instance_id -> stop in flight or done
        self.stop_sessions: dict[str, str] = {}  # instance_id -> session whose guard waits on it
        self._status_reader: TurnStatusReader | None = None
        self._write_batch: WriteBatch | None = None
        self._commands: dict[str, list[str] | None] = {}  # agent profile -> command, re-derived once per run

    # ------------------------------------------------------------------- the run
    async def recover(
        self,
        *,
        enabled: bool,
        start_own_server: Callable[[], Awaitable[AgentctlClient | None]],
        publish: Callable[[Execution], None],
    ) -> tuple[RecoveryReport, AgentctlClient | None]:
        """Run it; the client is None when no server could be started (the backend then keeps
        trying through its control-server link, and every inherited row is settled meanwhile)."""
        report = RecoveryReport()
        record = self.read_server_record()
        if not enabled:
            # No adoption, nothing recovered; an own survivor is stopped, not adopted (AC-EXECUTORS-SURVIVAL-005.1, AC-EXECUTORS-SURVIVAL-005.5).
            adoption = await self.adopter.shutdown_own(record)
            report.adoption = adoption
            self._log_adoption(adoption, record)
            client = await start_own_server()
            # AC-EXECUTORS-CONTROL-OWNERSHIP-004.7: a survivor we could not stop keeps its rows untouched until a later start.
            scope = Scope(disabled=not adoption.stop_failed, adopted=False, answered=adoption.stop_failed)
            self.reconcile(set(), report, scope)
            return report, client

        # 1. guards, before any contact (AC-EXECUTORS-SURVIVAL-002.8, AC-EXECUTORS-SURVIVAL-005.3)
        records = self.take_guards()
        standalone = [r for r in records if not r.passthrough]
        for rec in records:
            if rec.passthrough:
                report.not_retracked[rec.session_id] = "passthrough"

        # 2. the recorded server; D starts at first contact (AC-EXECUTORS-SURVIVAL-003.7)
        started = time.monotonic()
        deadline = started + self.deadline_s

        # 3. adoption gate (never cancelled; a late adoption re-tracks nothing)
        adoption = await self.adopter.adopt(record)
        report.adoption = adoption
        self._log_adoption(adoption, record)
        if adoption.client is None:
            for rec in standalone:
                report.not_retracked[rec.session_id] = adoption.reason or "no_server"
            client = await start_own_server()
            self._release_guards(standalone)
            report.duration_ms = (time.monotonic() - started) * 1000
            # Rows of a reachable server we did not adopt are unknown; a stopped one's are repaired (AC-EXECUTORS-CONTROL-OWNERSHIP-004.3).
            scope = Scope(disabled=False, adopted=False, answered=adoption.answered and not adoption.stopped,
                          created_by_us=self.boot_id)
            self.reconcile(set(), report, scope)
            return report, client
        client = adoption.client
        if time.monotonic() >= deadline:
            self.past_deadline = True

        # 4. enumerate; correlate by the session identity the server holds (AC-EXECUTORS-SURVIVAL-002.1). Enumeration is
        #    bounded by what is left of D; after a late adoption only by the read budget, so that the
        #    instances of records without an outcome can still be found and stopped (AC-EXECUTORS-SURVIVAL-003.7).
        try:
            if self.past_deadline:
                listing = await self._budget(client.list_instances)
            else:
                remaining = max(0.001, deadline - time.monotonic())
                reply = await client.call("list_instances", timeout=remaining)
                listing = list(reply.get("instances") or []) if isinstance(reply, dict) else []
        except (IpcError, TimeoutError) as exc:
            # Cannot enumerate: recover nothing, stop nothing, no second server (AC-EXECUTORS-SURVIVAL-002.12).
            log.warning("enumeration failed: %s", exc)
            for rec in standalone:
                report.not_retracked[rec.session_id] = "enumeration_failed"
            self._release_guards(standalone)
            report.duration_ms = (time.monotonic() - started) * 1000
            self.reconcile(set(), report, Scope(disabled=False, adopted=True, answered=True, enumeration=None))
            return report, client
        live = [i for i in listing if i.get("state") not in ("exited", "stopping", "stopped")]
        by_session: dict[str, list[dict[str, Any]]] = {}
        for inst in live:
            by_session.setdefault(str(inst.get("session_id")), []).append(inst)
        recorded = {r.session_id for r in records}
        for session_id, insts in by_session.items():
            if session_id not in recorded:  # no inventory record → stopped (AC-EXECUTORS-SURVIVAL-002.6)
                for inst in insts:
                    report.stopped_orphans.append(inst["instance_id"])
                    self._stop(client, inst["instance_id"], None)
        jobs: dict[asyncio.Task[Execution | None], Record] = {}
        late: list[Record] = []  # adopted after D: nothing a read could still publish, so none is made
        for rec in standalone:
            if rec.session_id in self.executions.executions:
                report.retracked.append(rec.session_id)  # already tracked: the same set, no second execution (AC-EXECUTORS-SURVIVAL-002.9)
                continue
            candidates = by_session.get(rec.session_id, [])
            if not candidates:
                report.not_retracked[rec.session_id] = "no_instance"  # repair path (AC-EXECUTORS-SURVIVAL-002.7)
                continue
            if self.past_deadline:
                late.append(rec)
                continue
            task = asyncio.get_running_loop().create_task(
                self._retrack_record(client, rec, candidates, report, publish)
            )
            jobs[task] = rec
        if jobs:
            _, pending = await asyncio.wait(jobs, timeout=max(0.0, deadline - time.monotonic()))
        else:
            pending = set()

        # 5. the deadline: whatever has no outcome is not re-tracked and its instance stopped; a job
        #    still in flight runs on (never cancelled) but can no longer change that (``_decline``)
        self.past_deadline = True
        for rec in late + [jobs[task] for task in pending]:
            report.not_retracked[rec.session_id] = "deadline"
            for inst in by_session.get(rec.session_id, []):
                self._stop(client, inst["instance_id"], rec.session_id)
        if self.stops:
            await asyncio.wait(self.stops.values(), timeout=max(0.0, deadline - time.monotonic()))
        in_flight = {iid for iid, t in self.stops.items() if not t.done()}
        for iid, stop in self.stops.items():
            if stop.done() and not stop.result():
                report.failed_stops[iid] = "stop failed after retries"
        for session_id, reason in report.not_retracked.items():
            log_event("session_not_retracked", f"session {session_id} not re-tracked: {reason}",
                      SESSION_ID=session_id, REASON=reason)
        report.duration_ms = (time.monotonic() - started) * 1000
        self._release_guards(standalone)

        # 6. one enumeration after every outcome, then reconciliation (AC-EXECUTORS-SURVIVAL-003.1, AC-EXECUTORS-SURVIVAL-003.6)
        try:
            after = await self._budget(client.list_instances)
            present = {i["instance_id"] for i in after if i.get("state") not in ("exited", "stopped")}
        except IpcError:
            present = None
        scope = Scope(disabled=False, adopted=True, answered=True, enumeration=present,
                      stops_in_flight=in_flight, created_by_us=self.boot_id)
        self.reconcile(set(report.retracked), report, scope)
        return report, client

    # ------------------------------------------------------------- per record
    async def _retrack_record(
        self,
        client: AgentctlClient,
        rec: Record,
        candidates: list[dict[str, Any]],
        report: RecoveryReport,
        publish: Callable[[Execution], None],
    ) -> Execution | None:
        if len(candidates) > 1:
            # Duplicates: only the instance whose id is the record's agent execution id (AC-EXECUTORS-SURVIVAL-002.10).
            winners = [i for i in candidates if i["instance_id"] == rec.instance_id]
            losers = [i for i in candidates if i["instance_id"] != rec.instance_id]
            if len(winners) != 1:
                self._decline(report, rec, "duplicate_ambiguous")
                for inst in candidates:
                    self._stop(client, inst["instance_id"], rec.session_id)
                return None
            stopped = await asyncio.gather(*(self._stop(client, i["instance_id"], rec.session_id) for i in losers))
            if not all(stopped):  # a loser still runs: the winner is not re-tracked either (AC-EXECUTORS-SURVIVAL-002.15)
                self._decline(report, rec, "duplicate_stop_failed")
                await self._stop(client, winners[0]["instance_id"], rec.session_id)
                return None
            candidates = winners
        instance = candidates[0]
        try:
            values = reconstruct(rec, instance, self._commands)
        except MissingInput as exc:
            self._decline(report, rec, f"missing_input={exc.name}")
            log_event("retrack_missing_input", f"session {rec.session_id}: required value {exc.name} missing",
                      SESSION_ID=rec.session_id, INSTANCE_ID=instance.get("instance_id"), REASON=exc.name)
            await self._stop(client, instance["instance_id"], rec.session_id)
            return None
        try:
            status = await self._statuses(client).read(instance["instance_id"])
        except IpcError as exc:
            # Never publish as running what we could not read (AC-EXECUTORS-SURVIVAL-004.5): stop it instead.
            if self.past_deadline:  # the read was in flight at D (its instance is being stopped for it)
                self._finished_late(rec, f"turn-status read failed: {exc.code}")
                return None
            self._decline(report, rec, "turn_status_failed")
            await self._stop(client, instance["instance_id"], rec.session_id)
            return None
        if self.past_deadline:  # completed after D: publishes nothing, changes no state (AC-EXECUTORS-SURVIVAL-003.7)
            self._finished_late(rec, "turn status read")
            return None
        outcomes = list(status.get("outcomes") or [])
        current = status.get("current_turn_id")
        agent = AgentIdentity.reported(instance)
        # applied now (not already durable), so their turn_ended event is still to be replayed;
        # filled by apply() before after() publishes the execution that holds it
        replaying: set[str] = set()

        def apply(db: Any) -> None:  # what ended while unattached, before publishing (AC-EXECUTORS-SURVIVAL-004.2)
            for out in outcomes:
                if apply_turn_outcome(db, rec.session_id, str(out["turn_id"]), out.get("stop_reason"),
                                      out.get("error")):
                    replaying.add(str(out["turn_id"]))
            mark_replaying(db, rec.session_id, replaying)  # for followers on other hosts (Issue 47 item 3)
            session = db.get(TaskSession, rec.session_id)
            if current and session is not None:  # a turn still running is published as running (AC-EXECUTORS-SURVIVAL-003.3)
                ensure_turn(db, rec.session_id, str(current), None)
                mark_running(db, session, f"turn {current} still running at re-tracking")
            elif session is not None:  # no turn runs: a session still RUNNING lost its prompt with the old backend
                mark_waiting_without_turn(db, session, "no turn running at re-tracking")
            row = db.get(ExecutorRunning, rec.session_id)
            if row is not None:
                row.instance_id = values["instance_id"]
                agent.record(row)
                row.updated_at = datetime.now(UTC)

        ex = Execution(
            session_id=rec.session_id,
            task_id=rec.task_id,
            instance_id=values["instance_id"],
            agent=agent,
            acp_session_id=values["acp_session_id"],
            retracked=True,
            last_seq=rec.last_event_seq,
            applied_turns={str(o["turn_id"]) for o in outcomes},
            replaying_turns=replaying,
        )

        def after() -> None:  # in the callback that committed: no deadline can fall in between
            publish(ex)
            self.executions.release_guard(rec.session_id)
            report.retracked.append(rec.session_id)
            log_event(
                "session_retracked",
                f"session {rec.session_id} re-tracked: agent pid {ex.agent.pid} kept running",
                SESSION_ID=rec.session_id,
                TASK_ID=rec.task_id,
                INSTANCE_ID=ex.instance_id,
                AGENT_PID=ex.agent.pid,
            )

        # One transaction for every record ready in this loop iteration (daemon.backend.recovery.batch);
        # a batch flushed after D writes and publishes nothing (AC-EXECUTORS-SURVIVAL-003.7).
        if not await self._writes().write(rec.session_id, apply, after):
            return None
        # Acked only now that the outcomes are durable, each in its own exchange (AC-EXECUTORS-SURVIVAL-004.6).
        for out in outcomes:
            try:
                await client.ack_turn(str(out["turn_id"]))
            except IpcError as exc:
                log.warning("ack_turn %s failed (a later backend re-applies it harmlessly): %s", out["turn_id"], exc)
        return ex

    def _decline(self, report: RecoveryReport, rec: Record, reason: str) -> None:
        """Record why ``rec`` is not re-tracked, unless the deadline decided it first.

        At D every record without an outcome is not re-tracked for ``deadline`` and its instance
        is stopped; its job runs on (never cancelled), but what it learns afterwards is a
        consequence, not the cause: its turn-status read, in flight at D, fails because the
        deadline's own stop removed the instance (or times out on a loaded host). That must not
        turn ``deadline`` into ``turn_status_failed`` (AC-EXECUTORS-SURVIVAL-003.7)."""
        if self.past_deadline:
            report.not_retracked.setdefault(rec.session_id, "deadline")
            self._finished_late(rec, reason)
        else:
            report.not_retracked[rec.session_id] = reason

    def _finished_late(self, rec: Record, what: str) -> None:
        """A record's work in flight at D finished: recorded, re-tracks nothing (AC-EXECUTORS-SURVIVAL-003.7)."""
        log_event("retrack_after_deadline", f"session {rec.session_id}: its re-tracking ended after the recovery"
                  f" deadline ({what}); not re-tracked: deadline", SESSION_ID=rec.session_id, REASON=what)

    # ------------------------------------------------------------------ steps
    def take_guards(self) -> list[Record]:
        """Guard every session named by a live standalone row (AC-EXECUTORS-SURVIVAL-002.8)."""
        records: list[Record] = []
        with self.store.session() as db:
            rows = db.execute(
                select(ExecutorRunning, TaskSession.passthrough)
                .join(TaskSession, TaskSession.id == ExecutorRunning.session_id, isouter=True)
                .where(ExecutorRunning.status == InventoryStatus.LIVE, ExecutorRunning.runtime == "standalone",
                       self.adopter.identity.own_sessions())
            ).all()
            for row, passthrough in rows:
                records.append(
                    Record(
                        session_id=row.session_id,
                        task_id=row.task_id,
                        instance_id=row.instance_id,
                        last_event_seq=row.last_event_seq or 0,
                        # Mode unreadable → guarded, not excluded (AC-EXECUTORS-SURVIVAL-005.3).
                        passthrough=bool(passthrough) if passthrough is not None else False,
                        agent_profile=row.agent_profile,
                        workspace_path=row.workspace_path,
                    )
                )
        for rec in records:
            if not rec.passthrough:
                self.executions.acquire_guard(rec.session_id)  # a session already tracked is left unguarded
        return records

    def _statuses(self, client: AgentctlClient) -> TurnStatusReader:
        """The records' turn-status reads, coalesced (one ``turn_statuses`` per chunk), each on the read budget."""
        if self._status_reader is None:
            self._status_reader = TurnStatusReader(client, self._budget)
        return self._status_reader

    def _writes(self) -> WriteBatch:
        """The records' store writes, one transaction per loop iteration; none after D."""
        if self._write_batch is None:
            self._write_batch = WriteBatch(self.store, admit=lambda: not self.past_deadline, preload=_preload)
        return self._write_batch

    def read_server_record(self) -> ControlServerRecord | None:
        with self.store.session() as db:
            rec = self.adopter.identity.record(db)
            if rec is not None:
                db.expunge(rec)
            return rec

    async def _budget(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        return await self.adopter.budget(fn)

    def _stop(self, client: AgentctlClient, instance_id: str, session_id: str | None) -> asyncio.Task[bool]:
        """Stop an instance on the read budget, once; the task is never cancelled (AC-EXECUTORS-SURVIVAL-003.7)."""
        task = self.stops.get(instance_id)
        if task is not None:
            return task

        async def run() -> bool:
            try:
                await self._budget(lambda: client.stop_instance(instance_id))
                return True
            except IpcError as exc:
                if exc.code == ErrorCode.NOT_FOUND:
                    return True  # already absent counts as success
                log_event("stop_failed", f"could not stop instance {instance_id}: {exc}", priority=3,
                          INSTANCE_ID=instance_id, SESSION_ID=session_id, REASON=exc.code)
                return False

        task = asyncio.get_running_loop().create_task(run())
        self.stops[instance_id] = task
        if session_id is not None:
            self.stop_sessions[instance_id] = session_id
            self.executions.hold_guard(session_id)
            task.add_done_callback(functools.partial(self._stop_resolved, session_id))
        return task

    def _stop_resolved(self, session_id: str, task: asyncio.Task[bool]) -> None:
        ok = not task.cancelled() and task.exception() is None and task.result()
        if ok:
            self.executions.release_held_guard(session_id)
            if self.reconciled:  # it was unknown while in flight; now it is known dead (AC-EXECUTORS-SURVIVAL-003.6 rule 5)
                with self.store.session() as db:
                    self._repair(db, session_id, datetime.now(UTC))
        else:  # an agent that could not be stopped keeps its session guarded (AC-EXECUTORS-SURVIVAL-002.16)
            self.executions.mark_unstopped(session_id)

    def _release_guards(self, records: list[Record]) -> None:
        for rec in records:
            self.executions.release_guard(rec.session_id)

    def _log_adoption(self, adoption: Adoption, record: ControlServerRecord | None) -> None:
        log_event(
            "adoption",
            f"control server adoption: {adoption.outcome}" + (f" ({adoption.reason})" if adoption.reason else ""),
            OUTCOME=adoption.outcome,
            REASON=adoption.reason,
            SERVER_IDENTITY=record.server_identity if record else None,
            STOPPED=int(adoption.stopped),
        )

    # ---------------------------------------------------------- reconciliation
    def reconcile(self, retracked: set[str], report: RecoveryReport, scope: Scope) -> None:
        """Startup state reconciliation: repair what the restart interrupted, and only that.

        Re-tracked sessions are skipped entirely: the task is not marked
        interrupted, a running session stays running, open turns stay open, a
        task in progress stays in progress (AC-EXECUTORS-SURVIVAL-003.2, AC-EXECUTORS-SURVIVAL-003.3, AC-EXECUTORS-SURVIVAL-003.4, AC-EXECUTORS-SURVIVAL-003.5).
        Every other live row is classified (AC-EXECUTORS-SURVIVAL-003.6): dead rows go to the repair
        path (resume token and worktree kept; open turns abandoned; an active
        session waits for input and its task goes to review, marked
        interrupted — what kandev always did); unknown rows are left untouched.
        """
        now = datetime.now(UTC)
        with self.store.session() as db:
            own = self.adopter.identity.own_sessions()  # another host's sessions are its own backend's
            rows = db.scalars(select(ExecutorRunning).join(TaskSession, TaskSession.id == ExecutorRunning.session_id)
                              .where(ExecutorRunning.status == InventoryStatus.LIVE, own)).all()
            untouched: set[str] = set(retracked)
            for row in rows:
                if row.session_id in retracked:
                    continue
                verdict = classify(
                    instance_id=row.instance_id,
                    agent=AgentIdentity.recorded(row),
                    created_by_boot=row.created_by_boot,
                    scope=scope,
                )
                if verdict != DEAD:
                    untouched.add(row.session_id)
                    report.unknown.append(row.session_id)
                    report.not_retracked.setdefault(row.session_id, f"liveness_{verdict}")
            sessions = db.scalars(select(TaskSession).where(TaskSession.state.in_(ACTIVE_STATES), own)).all()
            to_repair = {row.session_id for row in rows} | {s.id for s in sessions}
            for session_id in sorted(to_repair - untouched):
                self._repair(db, session_id, now)
                report.not_retracked.setdefault(session_id, "interrupted")
        self.reconciled = True

    def _repair(self, db: Any, session_id: str, now: datetime) -> None:
        repair_interrupted(db, session_id, now, interruption={"cause": "backend_restart", "at": iso_utc(now)})


def _preload(db: Any, session_ids: list[str]) -> list[Any]:
    """Load the sessions and inventory rows a batch of re-tracking writes touches, one query per
    table and chunk, so each record's ``db.get`` finds them in the session (no query per record).
    The caller keeps the returned rows referenced: the session's identity map holds them weakly."""
    rows: list[Any] = []
    for start in range(0, len(session_ids), 500):
        chunk = session_ids[start : start + 500]
        rows += db.scalars(select(TaskSession).where(TaskSession.id.in_(chunk))).all()
        rows += db.scalars(select(ExecutorRunning).where(ExecutorRunning.session_id.in_(chunk))).all()
    return rows
