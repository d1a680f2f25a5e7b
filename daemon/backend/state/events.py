"""Applying control-server events and turn outcomes to the store.

Every event carries a per-instance ``seq``. A batch of events is applied in one
transaction together with the inventory row's ``last_event_seq``, so after any
crash the backend re-attaches with ``after_seq = last_event_seq`` and neither
loses nor duplicates a transcript entry (AC-EXECUTORS-SURVIVAL-001.5).

A turn's terminal outcome can arrive twice: as a retained outcome read with
``turn_status`` and as a ``turn_ended`` event. ``apply_turn_outcome`` is
idempotent against durable state (a finished turn stays as it is), and the
caller also remembers applied turn ids for this process lifetime
(AC-EXECUTORS-SURVIVAL-004.4, AC-EXECUTORS-SURVIVAL-004.6).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Integer, Table, bindparam, case, func, select, update
from sqlalchemy.orm import Session as DbSession

from daemon.agentctl.protocol import EventKind
from daemon.agents.memory import human_bytes
from daemon.store import transcript, transitions
from daemon.store.board import MEMORY_KILLED
from daemon.store.models import ExecutorRunning, TaskSession, Turn
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import InventoryStatus, SessionState, TaskState, TurnState
from daemon.store.transcript import TranscriptWriter, ensure_turn

# ACP session updates that carry text for the transcript, and the role they get.
_TEXT_UPDATES = {
    "agent_message_chunk": "agent",
    "agent_thought_chunk": "agent",
    "user_message_chunk": "user",
}
# Stop reasons after which the session waits for the next prompt.
_AGENT_DIED = "agent_exited"
_CANCELLED = "cancelled"
TIMEOUT = "timeout"
"""The stop reason of a turn the backend ended because its agent said nothing for
``agents.turn_timeout_s`` seconds (``mark_timed_out``)."""


def _now() -> datetime:
    return datetime.now(UTC)


# Statements of every batch, built once on the tables (see daemon.store.transcript's note).
_RUNNING = cast(Table, ExecutorRunning.__table__)
_TASK_SESSIONS = cast(Table, TaskSession.__table__)
_SESSION_EXISTS = select(_TASK_SESSIONS.c.id).where(_TASK_SESSIONS.c.id == bindparam("sid"))
_TOP = bindparam("top", type_=Integer())
_ADVANCE_SEQ = (update(_RUNNING)  # the highest seq applied, on the session's current instance only
                .where(_RUNNING.c.session_id == bindparam("sid"), _RUNNING.c.instance_id == bindparam("iid"))
                .values(last_event_seq=case((func.coalesce(_RUNNING.c.last_event_seq, 0) < _TOP, _TOP),
                                            else_=_RUNNING.c.last_event_seq),
                        updated_at=bindparam("now")))


@dataclass
class ApplyResult:
    """What a batch did that needs action after its commit."""

    ended_turns: list[tuple[str, str | None]] = field(default_factory=list)  # (turn_id, stop_reason)
    agent_exited: bool = False


def apply_turn_outcome(
    db: DbSession, session_id: str, turn_id: str, stop_reason: str | None, error: str | None
) -> bool:
    """Apply one terminal turn outcome; returns False if durable state already shows it."""
    turn = ensure_turn(db, session_id, turn_id, None)
    if turn.state in ("finished", "abandoned"):
        return False
    if turn.stop_reason == TIMEOUT and stop_reason == _CANCELLED:
        # the backend cancelled it for its agent's silence (mark_timed_out): said as such
        stop_reason, error = TIMEOUT, turn.error
    turn.state = TurnState.FINISHED
    turn.stop_reason = stop_reason
    turn.error = error
    turn.ended_at = _now()
    session = db.get(TaskSession, session_id)
    if session is None:
        return True
    if stop_reason == _AGENT_DIED:
        # The agent_exited event moves the session to FAILED; nothing to wait for.
        return True
    if session.state == SessionState.RUNNING and not _open_turns(db, session_id):
        transitions.transition_session(
            db,
            session_id,
            SessionState.WAITING_FOR_INPUT,
            expected_from={SessionState.RUNNING},
            reason=f"turn {turn_id} ended: {stop_reason}",
            last_error=error,
        )
        transitions.set_task_state(db, session.task_id, TaskState.REVIEW)
    return True


def mark_replaying(db: DbSession, session_id: str, turn_ids: set[str]) -> None:
    """Startup recovery stored these turns' outcomes before their last events are replayed: say so in
    their rows (``Turn.replaying``, for followers on other hosts; ``Execution.replaying_turns`` says it
    in memory), and take the mark off any other turn of the session (an earlier lifetime's)."""
    for turn in db.scalars(select(Turn).where(Turn.session_id == session_id, Turn.replaying.is_(True))):
        if turn.id not in turn_ids:
            turn.replaying = None
    for turn_id in turn_ids:
        marked = db.get(Turn, turn_id)
        if marked is not None:
            marked.replaying = True


def _open_turns(db: DbSession, session_id: str) -> int:
    """How many of the session's turns are open in the store."""
    count: int = db.scalar(
        select(func.count()).select_from(Turn).where(Turn.session_id == session_id, Turn.state == TurnState.OPEN)
    ) or 0
    return count


def _set_runtime_config(session: TaskSession, key: str, value: Any) -> None:
    meta = SessionMetadata.load(session)
    runtime = dict(meta.runtime_config_or_empty())
    if key == "options":
        runtime["options"] = value
        model = value.pop("model", None) if isinstance(value, dict) else None
        if model is not None:
            runtime["model"] = model
    else:
        runtime[key] = value
    meta.set_runtime_config(runtime)
    meta.save(session)


def _config_options(update: dict[str, Any]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for opt in update.get("configOptions") or []:
        if isinstance(opt, dict) and "id" in opt:
            options[str(opt["id"])] = opt.get("currentValue")
    return options


def apply_events(db: DbSession, session_id: str, instance_id: str, events: list[Any]) -> ApplyResult:
    """Apply a batch of stream events (each with .seq, .kind, .data) in the caller's transaction.

    Transcript chunks go through one ``TranscriptWriter`` (coalesced, and an event the transcript
    already covers is skipped: exactly once)."""
    result = ApplyResult()
    if db.execute(_SESSION_EXISTS, {"sid": session_id}).first() is None:
        return result

    def session() -> TaskSession:  # loaded only by the events that change the session
        row = db.get(TaskSession, session_id)
        if row is None:  # deleted since the check above: the batch fails and is applied again later
            raise LookupError(f"session {session_id} vanished while its events were applied")
        return row

    writer = TranscriptWriter(db, session_id)
    now = _now()  # when this batch is stored: one clock read for all its entries

    # A run of text chunks (one kind, one turn, consecutive seqs: what a streaming agent sends)
    # is written with one append_run, in its place among the other events.
    run: list[str] = []
    run_kind: str = ""
    run_turn: Any = None
    run_first = run_next = 0

    def write_run() -> None:
        if run:
            writer.append_run(role=_TEXT_UPDATES[run_kind], kind=run_kind, texts=run,
                              turn_id=None if run_turn is None else str(run_turn), instance_id=instance_id,
                              first_seq=run_first, created_at=now)
            run.clear()

    def write(ev: Any, role: str, kind: str, text: str, turn_id: Any) -> None:  # the run is written first
        writer.append(role=role, kind=kind, text=text, turn_id=None if turn_id is None else str(turn_id),
                      instance_id=instance_id, event_seq=ev.seq, created_at=now)

    for ev in events:
        data = ev.data if isinstance(ev.data, dict) else {}
        turn_id = data.get("turn_id")
        if ev.kind == EventKind.SESSION_UPDATE:
            raw_update = data.get("update")
            update: dict[str, Any] = raw_update if isinstance(raw_update, dict) else {}
            kind = str(update.get("sessionUpdate") or "unknown")
            if kind in _TEXT_UPDATES:
                raw_content = update.get("content")
                content: dict[str, Any] = raw_content if isinstance(raw_content, dict) else {}
                if run and (kind != run_kind or turn_id != run_turn or ev.seq != run_next):
                    write_run()
                if not run:
                    run_kind, run_turn, run_first = kind, turn_id, ev.seq
                run.append(str(content.get("text") or ""))
                run_next = ev.seq + 1
                continue
        write_run()  # the run so far goes before this event
        if ev.kind == EventKind.TURN_STARTED:
            turn = ensure_turn(db, session_id, str(turn_id), str(data.get("text") or ""))
            if turn.state == TurnState.OPEN:
                mark_running(db, session(), f"turn {turn_id} started")
            write(ev, "user", "prompt", str(data.get("text") or ""), turn_id)
        elif ev.kind == EventKind.SESSION_UPDATE:  # one that is not a text chunk
            if kind == "current_mode_update":
                _set_runtime_config(session(), "mode", update.get("currentModeId"))
            elif kind == "config_option_update":
                _set_runtime_config(session(), "options", _config_options(update))
            write(ev, "agent", kind, json.dumps(update, sort_keys=True, default=str), turn_id)
        elif ev.kind == EventKind.TURN_ENDED:
            tid = str(turn_id)
            # Applied or already applied: either way it is acked and its waiters woken.
            apply_turn_outcome(db, session_id, tid, data.get("stop_reason"), data.get("error"))
            stored = db.get(Turn, tid)  # its stop reason as stored (a timeout: not the agent's "cancelled")
            if stored is not None and stored.replaying:
                stored.replaying = None  # its entries are in this commit: followers elsewhere may end it
            result.ended_turns.append((tid, stored.stop_reason if stored is not None else data.get("stop_reason")))
        elif ev.kind == EventKind.AGENT_EXITED:
            result.agent_exited = True
            code = data.get("exit_code")
            # A signal nobody in kandev sent (the OOM killer, a stray kill): said as such.
            sig = data.get("signal")
            if data.get("reason") == "memory":  # its memory bound (its memory cgroup) ended it
                how = killed_by_memory(data.get("max_memory"), sig, code)
                write(ev, "system", "agent_killed", how, None)
            else:
                how = f"agent killed by {sig} (exit code {code})" if sig else f"agent exited with code {code}"
                write(ev, "system", "agent_exited", how, None)
            mark_agent_gone(db, session_id, how)
        else:  # permission_request, agent_error and kinds added later: kept verbatim
            write(ev, "system", str(ev.kind), json.dumps(data, sort_keys=True, default=str), turn_id)
    write_run()
    writer.flush()
    if events:
        db.execute(_ADVANCE_SEQ, {"sid": session_id, "iid": instance_id, "top": max(ev.seq for ev in events),
                                  "now": now})
    return result


def killed_by_memory(max_memory: Any, sig: Any, code: Any) -> str:
    """What the session says of an agent its memory bound ended (its last error, its transcript)."""
    bound = f" of {human_bytes(max_memory)}" if isinstance(max_memory, int) and not isinstance(max_memory, bool) else ""
    return (f"{MEMORY_KILLED}: the agent used more than its memory bound{bound} (max_memory) and was killed"
            f" ({sig or 'killed'}, exit code {code}); nothing else was touched")


def mark_running(db: DbSession, session: TaskSession, reason: str) -> None:
    """A turn is open: the session runs and its task is in progress (a turn a previous backend
    started just before it died reaches us only through its events)."""
    if session.state == SessionState.WAITING_FOR_INPUT:
        transitions.transition_session(db, session.id, SessionState.RUNNING, expected_from={SessionState.WAITING_FOR_INPUT}, reason=reason)
        transitions.set_task_state(db, session.task_id, TaskState.IN_PROGRESS)


PROMPT_NOT_DELIVERED = "the last prompt did not reach the agent before the backend stopped; send it again"


def mark_waiting_without_turn(db: DbSession, session: TaskSession, reason: str) -> None:
    """No turn runs on the agent and none ended unread (re-tracking asked its control server), and
    the store holds no open turn: a session left RUNNING by a backend that died between marking it
    and handing the prompt to the agent (the turn row is written once the agent took the prompt)
    waits for input again, told why. An open turn row is left alone (AC-EXECUTORS-SURVIVAL-003.4).
    A turn that does run after all reaches us through its events and ``mark_running``."""
    if session.state != SessionState.RUNNING or _open_turns(db, session.id):
        return
    transitions.transition_session(db, session.id, SessionState.WAITING_FOR_INPUT,
                                   expected_from={SessionState.RUNNING}, reason=reason, last_error=PROMPT_NOT_DELIVERED)
    transitions.set_task_state(db, session.task_id, TaskState.REVIEW)


def mark_agent_gone(db: DbSession, session_id: str, reason: str) -> None:
    """The session's agent is dead: FAILED, open turns abandoned, inventory row stale (tokens kept)."""
    session = db.get(TaskSession, session_id)
    if session is None:
        return
    for turn in db.scalars(select(Turn).where(Turn.session_id == session_id, Turn.state == TurnState.OPEN)):
        turn.state = TurnState.ABANDONED
        turn.stop_reason = _AGENT_DIED
        turn.ended_at = _now()
    if session.state in (SessionState.STARTING, SessionState.RUNNING, SessionState.WAITING_FOR_INPUT):
        transitions.transition_session(
            db,
            session_id,
            SessionState.FAILED,
            expected_from={session.state},
            reason=reason,
            last_error=reason,
        )
    row = db.get(ExecutorRunning, session_id)
    if row is not None:
        row.status = InventoryStatus.STALE  # resume token and worktree identity are kept
        row.updated_at = _now()


def mark_timed_out(db: DbSession, session_id: str, turn_id: str, *, seconds: int, limit: int) -> bool:
    """The backend ends this open turn because its agent said nothing for ``seconds`` (at least
    ``agents.turn_timeout_s`` = ``limit``) and is about to cancel it: the open turn keeps the reason
    (stop reason ``timeout`` and the error, until its end arrives: ``apply_turn_outcome`` then says
    ``timeout`` where the agent says ``cancelled``) and the transcript says so. False if the turn is
    not open any more (it ended meanwhile: nothing to time out)."""
    turn = db.get(Turn, turn_id)
    if turn is None or turn.session_id != session_id or turn.state != TurnState.OPEN:
        return False
    turn.stop_reason = TIMEOUT
    turn.error = f"no output from the agent for {seconds} s (agents.turn_timeout_s = {limit})"
    transcript.append(db, session_id, role="system", kind="turn_timeout", text=f"{turn.error}; cancelling the turn",
                      turn_id=turn_id)
    return True
