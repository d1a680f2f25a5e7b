"""Startup recovery: adopt a surviving control server and re-track its agents.

Read ``recover`` top to bottom: it is the ordered list of design.md §7 and
design-notes §7.1, one step per block.

1. guards from the inventory, passthrough excluded (before any contact)
2. read the control-server record; the first contact starts the deadline
3. identify → credential → proof → authentication → capabilities
4. enumerate → correlate → reconstruct → read turn outcome → apply → publish
5. at the deadline, every record without an outcome is not re-tracked
6. release guards, then reconciliation reads the re-tracked set

With the capability disabled or unavailable there is no adoption and nothing
is reported recovered (AC-EXECUTORS-SURVIVAL-005.1); the backend starts its
own child control server and reconciliation repairs every live row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select

from daemon.agentctl.client import AgentctlClient, OwnershipRefused, identify
from daemon.agentctl.protocol import CAPABILITIES as REQUIRED_CAPABILITIES
from daemon.backend.events import apply_turn_outcome
from daemon.backend.executions import Execution, ExecutionStore
from daemon.journal import log_event
from daemon.store import transitions
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord, ExecutorRunning, TaskSession, Turn
from ipc.errors import IpcError

log = logging.getLogger(__name__)

ACTIVE_STATES = ("STARTING", "RUNNING")


@dataclass
class Record:
    """A live standalone recovery-inventory row, as read before any contact."""

    session_id: str
    task_id: str
    instance_id: str
    last_event_seq: int
    passthrough: bool


@dataclass
class Adoption:
    outcome: str  # "adopted" | "no_server" | "refused" | "disabled"
    reason: str | None = None
    client: AgentctlClient | None = None
    record: ControlServerRecord | None = None
    answered: bool = False  # a server answered at the recorded endpoint


@dataclass
class RecoveryReport:
    retracked: list[str] = field(default_factory=list)
    not_retracked: dict[str, str] = field(default_factory=dict)  # session_id -> reason
    stopped_orphans: list[str] = field(default_factory=list)
    duration_ms: float = 0.0
    adoption: Adoption = field(default_factory=lambda: Adoption("disabled"))


class Recovery:
    """One startup recovery run. Knows the store, the execution store and how to reach servers."""

    def __init__(
        self,
        store: Store,
        executions: ExecutionStore,
        *,
        deadline_s: float,
        read_timeout_s: float,
        read_retries: int,
        read_credential: Callable[[str], bytes],
        installation_id: str,
    ) -> None:
        self.store = store
        self.executions = executions
        self.deadline_s = deadline_s
        self.read_timeout_s = read_timeout_s
        self.read_retries = read_retries
        self.read_credential = read_credential
        self.installation_id = installation_id

    # ------------------------------------------------------------------ steps
    def take_guards(self) -> list[Record]:
        """Step 1: guard every session named by a live standalone row (AC-EXECUTORS-SURVIVAL-002.8)."""
        records: list[Record] = []
        with self.store.session() as db:
            rows = db.execute(
                select(ExecutorRunning, TaskSession.passthrough)
                .join(TaskSession, TaskSession.id == ExecutorRunning.session_id, isouter=True)
                .where(ExecutorRunning.status == "live", ExecutorRunning.runtime == "standalone")
            ).all()
            for row, passthrough in rows:
                records.append(
                    Record(
                        session_id=row.session_id,
                        task_id=row.task_id,
                        instance_id=row.instance_id,
                        last_event_seq=row.last_event_seq or 0,
                        # Unreadable mode → guarded, not excluded (AC-EXECUTORS-SURVIVAL-005.3).
                        passthrough=bool(passthrough) if passthrough is not None else False,
                    )
                )
        for rec in records:
            if not rec.passthrough:
                self.executions.acquire_guard(rec.session_id)
        return records

    def read_server_record(self) -> ControlServerRecord | None:
        with self.store.session() as db:
            rec = db.get(ControlServerRecord, 1)
            if rec is not None:
                db.expunge(rec)
            return rec

    async def adopt(self, record: ControlServerRecord | None) -> Adoption:
        """Step 3: prove the recorded server is ours before sending it anything that matters."""
        if record is None or not record.endpoint:
            return Adoption("no_server", None)
        info = await identify(record.endpoint, timeout=self.read_timeout_s)
        if info is None:
            return Adoption("no_server", "no_answer", record=record)
        if not info.get("server_identity") or not info.get("capabilities"):
            return Adoption("refused", "identity_mismatch", record=record, answered=True)
        if info["server_identity"] != record.server_identity:
            return Adoption("refused", "identity_mismatch", record=record, answered=True)
        try:
            credential = self.read_credential(record.credential_ref)
        except (OSError, ValueError) as exc:
            log.warning("stored control-server credential unreadable: %s", exc)
            return Adoption("refused", "credential_unavailable", record=record, answered=True)
        try:
            client = await AgentctlClient.connect(
                record.endpoint,
                credential=credential,
                installation_id=self.installation_id,
                expected_identity=record.server_identity,
                timeout=self.read_timeout_s,
            )
        except OwnershipRefused as exc:
            return Adoption("refused", exc.reason, record=record, answered=True)
        except IpcError as exc:
            return Adoption("refused", "authentication_failure" if exc.code == "unauthenticated" else "no_answer",
                            record=record, answered=True)
        missing = set(REQUIRED_CAPABILITIES) - set(client.capabilities)
        if missing:
            await client.close()
            return Adoption("refused", "capability_incompatibility", record=record, answered=True)
        try:
            await client.claim()  # a successful adoption counts as a renewal
        except IpcError as exc:
            await client.close()
            reason = "shutting_down" if exc.code == "shutting_down" else "credential_rotation_failure"
            return Adoption("no_server" if reason == "shutting_down" else "refused", reason, record=record,
                            answered=True)
        return Adoption("adopted", None, client=client, record=record, answered=True)

    async def _read(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """One bounded read on the read budget: timeout T, R retries, no pause (AC-EXECUTORS-SURVIVAL-002.13)."""
        last: Exception | None = None
        for _ in range(self.read_retries + 1):
            try:
                return await asyncio.wait_for(fn(), timeout=self.read_timeout_s)
            except (TimeoutError, IpcError) as exc:
                if isinstance(exc, IpcError) and exc.code not in ("timeout", "unavailable"):
                    raise
                last = exc
        raise IpcError("timeout", f"read failed after {self.read_retries + 1} attempts: {last}")

    async def retrack_one(self, client: AgentctlClient, rec: Record, instance: dict[str, Any]) -> Execution:
        """Step 4 for one session: rebuild the execution, apply a retained outcome, publish."""
        status = await self._read(lambda: client.turn_status(instance["instance_id"]))
        outcomes = list(status.get("outcomes") or [])
        with self.store.session() as db:
            for out in outcomes:
                apply_turn_outcome(db, rec.session_id, str(out["turn_id"]), out.get("stop_reason"),
                                   out.get("error"))
            row = db.get(ExecutorRunning, rec.session_id)
            if row is not None:
                row.instance_id = instance["instance_id"]
                row.agent_pid = instance.get("pid")
                row.agent_pid_start_time = instance.get("pid_start_time")
                row.updated_at = datetime.now(UTC)
        # Acked only after the outcomes are durable, in exchanges of their own.
        for out in outcomes:
            with contextlib.suppress(IpcError):
                await client.ack_turn(str(out["turn_id"]))
        ex = Execution(
            session_id=rec.session_id,
            task_id=rec.task_id,
            instance_id=instance["instance_id"],
            agent_pid=instance.get("pid"),
            agent_pid_start_time=instance.get("pid_start_time"),
            acp_session_id=instance.get("acp_session_id"),
            retracked=True,
            last_seq=rec.last_event_seq,
            applied_turns={str(o["turn_id"]) for o in outcomes},
        )
        return ex

    # ---------------------------------------------------------------- the run
    async def recover(
        self,
        *,
        enabled: bool,
        start_own_server: Callable[[], Awaitable[AgentctlClient]],
        publish: Callable[[Execution], None],
    ) -> tuple[RecoveryReport, AgentctlClient]:
        report = RecoveryReport()
        if not enabled:
            # Disabled or unavailable: no adoption, nothing recovered (AC-EXECUTORS-SURVIVAL-005.1).
            client = await start_own_server()
            self.reconcile(set(), report)
            return report, client

        # 1. guards, before any contact
        records = self.take_guards()
        standalone = [r for r in records if not r.passthrough]

        # 2. the recorded server; the deadline starts at first contact (AC-EXECUTORS-SURVIVAL-003.7)
        record = self.read_server_record()
        started = time.monotonic()
        deadline = started + self.deadline_s

        # 3. adoption gate
        adoption = await self.adopt(record)
        report.adoption = adoption
        log_event(
            "adoption",
            f"control server adoption: {adoption.outcome}" + (f" ({adoption.reason})" if adoption.reason else ""),
            OUTCOME=adoption.outcome,
            REASON=adoption.reason,
            SERVER_IDENTITY=record.server_identity if record else None,
        )
        if adoption.client is None:
            for rec in standalone:
                report.not_retracked[rec.session_id] = adoption.reason or "no_server"
            client = await start_own_server()
            self._release_guards(standalone)
            report.duration_ms = (time.monotonic() - started) * 1000
            self.reconcile(set(), report)
            return report, client
        client = adoption.client

        # 4. enumerate and correlate by the session identity the server holds (AC-EXECUTORS-SURVIVAL-002.1)
        try:
            listing = await self._read(client.list_instances)
        except IpcError as exc:
            # Cannot enumerate: recover nothing, stop nothing (AC-EXECUTORS-SURVIVAL-002.12).
            for rec in standalone:
                report.not_retracked[rec.session_id] = "enumeration_failed"
            self._release_guards(standalone)
            report.duration_ms = (time.monotonic() - started) * 1000
            log.warning("enumeration failed: %s", exc)
            self.reconcile(set(), report)
            return report, client
        instances = [i for i in listing if i.get("state") != "exited"]
        by_session: dict[str, list[dict[str, Any]]] = {}
        for inst in instances:
            by_session.setdefault(str(inst.get("session_id")), []).append(inst)
        to_stop: list[str] = []
        recorded = {r.session_id for r in records}
        for session_id, insts in by_session.items():
            if session_id not in recorded:  # no inventory record: stop it (AC-EXECUTORS-SURVIVAL-002.6)
                to_stop += [i["instance_id"] for i in insts]
                report.stopped_orphans += [i["instance_id"] for i in insts]
        jobs: dict[asyncio.Task[Execution], Record] = {}
        for rec in standalone:
            if rec.session_id in self.executions.executions:
                continue  # already tracked: idempotent (AC-EXECUTORS-SURVIVAL-002.9)
            candidates = by_session.get(rec.session_id, [])
            if not candidates:
                report.not_retracked[rec.session_id] = "no_instance"  # repair path (002.7)
                continue
            if len(candidates) > 1:  # duplicate tie-break on the agent execution id (002.10)
                winners = [i for i in candidates if i["instance_id"] == rec.instance_id]
                losers = [i["instance_id"] for i in candidates if i not in winners]
                to_stop += losers
                if len(winners) != 1:
                    report.not_retracked[rec.session_id] = "duplicate_ambiguous"
                    to_stop += [i["instance_id"] for i in winners]
                    continue
                candidates = winners
            jobs[asyncio.get_running_loop().create_task(self.retrack_one(client, rec, candidates[0]))] = rec

        # 5. one deadline for all of it; work in flight is not cancelled, only ignored
        if jobs:
            done, pending = await asyncio.wait(jobs, timeout=max(0.0, deadline - time.monotonic()))
        else:
            done, pending = set(), set()
        for task in done:
            rec = jobs[task]
            exc = task.exception()
            if exc is not None:
                report.not_retracked[rec.session_id] = "failed_read"
                to_stop.append(by_session[rec.session_id][0]["instance_id"])
                continue
            ex = task.result()
            publish(ex)
            self.executions.release_guard(rec.session_id)
            report.retracked.append(rec.session_id)
            log_event(
                "session_retracked",
                f"session {rec.session_id} re-tracked: agent pid {ex.agent_pid} kept running",
                SESSION_ID=rec.session_id,
                TASK_ID=rec.task_id,
                INSTANCE_ID=ex.instance_id,
                AGENT_PID=ex.agent_pid,
            )
        for task in pending:
            rec = jobs[task]
            report.not_retracked[rec.session_id] = "deadline"
            to_stop.append(by_session[rec.session_id][0]["instance_id"])
        for instance_id in to_stop:
            with contextlib.suppress(IpcError):
                await self._read(lambda iid=instance_id: client.stop_instance(iid))
        for session_id, reason in report.not_retracked.items():
            log_event("session_not_retracked", f"session {session_id} not re-tracked: {reason}",
                      SESSION_ID=session_id, REASON=reason)

        # 6. guards released, then reconciliation reads the re-tracked set (AC-EXECUTORS-SURVIVAL-003.1)
        self._release_guards(standalone)
        report.duration_ms = (time.monotonic() - started) * 1000
        self.reconcile(set(report.retracked), report)
        return report, client

    def _release_guards(self, records: list[Record]) -> None:
        for rec in records:
            self.executions.release_guard(rec.session_id)

    def reconcile(self, retracked: set[str], report: RecoveryReport) -> None:
        """Startup state reconciliation: what the restart interrupted, and only that.

        Re-tracked sessions are skipped entirely: their task is not marked
        interrupted, a running session stays running and its open turns stay
        open (AC-EXECUTORS-SURVIVAL-003.2..003.5). Every other live row goes to
        the repair path (resume token and worktree kept), its open turns are
        abandoned, an active session waits for input and its task goes to review
        marked interrupted — the behaviour kandev always had.
        """
        now = datetime.now(UTC)
        with self.store.session() as db:
            rows = db.scalars(select(ExecutorRunning).where(ExecutorRunning.status == "live")).all()
            for row in rows:
                if row.session_id in retracked:
                    continue
                row.status = "stale"
                row.updated_at = now
            sessions = db.scalars(select(TaskSession).where(TaskSession.state.in_(ACTIVE_STATES))).all()
            for session in sessions:
                if session.id in retracked:
                    continue
                for turn in db.scalars(select(Turn).where(Turn.session_id == session.id, Turn.state == "open")):
                    turn.state = "abandoned"
                    turn.stop_reason = "interrupted"
                    turn.ended_at = now
                transitions.transition_session(
                    db,
                    session.id,
                    "WAITING_FOR_INPUT",
                    expected_from={session.state},
                    reason="interrupted by backend restart",
                )
                transitions.set_task_state(db, session.task_id, "review", interrupted=True)
                report.not_retracked.setdefault(session.id, "interrupted")
