"""The invariant checker of a chaos run (Issue 45 item 1), on what the backend says and what the
box's process table shows:

- every chunk once and in order: a ``/slow N`` or ``/flood N`` turn's chunks are always a prefix of
  ``1/N .. N/N`` and all of them once it ended ``end_turn``; a ``/permission`` turn says its answer
  at most once; no chunk of a turn arrives after the turn was seen ended;
- every turn ends exactly once: a turn seen ended never shows open again nor another stop reason,
  and a session has at most one open turn, only while it is RUNNING;
- no orphan process: every process of the control server's unit is the server or belongs to the
  agent of a session that shows it live, and no mock agent runs outside that unit;
- no session in a transitional state (CREATED, STARTING) past a bound;
- truthful: a session shows ``live`` exactly when its agent runs, an open permission request only on
  a RUNNING session, and the board puts each task where the session's state and its agent's real
  liveness place it (``daemon.store.board.placement``).

``Tracked`` keeps what was seen of one session across snapshots; ``ingest`` adds a ``session
show`` page to it and returns the violations of the first two kinds (they never heal: a duplicate
stays a duplicate). ``unsettled`` returns the problems of the others, which a check waits a bound
for before it calls them violations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from daemon.store.board import placement

TRANSITIONAL = ("CREATED", "STARTING")
AGENTCTL_UNIT = "kandev-agentctl.service"
_STREAM = re.compile(r"^/(slow|flood) (\d+)$")
PERMISSION_PROMPT = "/permission"
PERMISSION_ANSWERS = ("permission: allow", "permission: reject", "permission: cancelled")


def expected_chunks(prompt: str) -> list[str] | None:
    """All the chunks of a streaming turn, in order (None: not a streaming prompt)."""
    m = _STREAM.match(prompt)
    if m is None:
        return None
    n = int(m.group(2))
    return [f"{i}/{n} " for i in range(1, n + 1)]


@dataclass
class TurnSeen:
    turn_id: str
    prompt: str
    chunks: list[str] = field(default_factory=list)
    stop_reason: str | None = None
    ended: bool = False
    ended_before: bool = False  # seen ended in an earlier snapshot than the current one
    broken: bool = False  # its chunks were reported wrong once (later snapshots repeat it no more)


@dataclass
class Tracked:
    """One session as the run has seen it."""

    sid: str
    task_id: str
    permission: bool  # this session runs /permission turns, the others stream
    victim: bool = False  # this session idles until an OOM fault asks its agent to allocate past its bound
    cursor: int = 0
    turns: dict[str, TurnSeen] = field(default_factory=dict)

    def open_turn(self) -> TurnSeen | None:
        return next((t for t in self.turns.values() if not t.ended), None)


def _chunk_problem(turn: TurnSeen) -> str | None:
    expected = expected_chunks(turn.prompt)
    if expected is not None:
        if turn.chunks != expected[:len(turn.chunks)]:
            at = next((i for i, (a, b) in enumerate(zip(turn.chunks, expected, strict=False)) if a != b),
                      min(len(turn.chunks), len(expected)))
            return (f"turn {turn.turn_id} ({turn.prompt}): chunk {at + 1} is "
                    f"{turn.chunks[at] if at < len(turn.chunks) else None!r}, expected "
                    f"{expected[at] if at < len(expected) else 'none'!r} ({len(turn.chunks)} chunks)")
        if turn.ended and turn.stop_reason == "end_turn" and len(turn.chunks) != len(expected):
            return f"turn {turn.turn_id} ({turn.prompt}) ended end_turn with {len(turn.chunks)} of {len(expected)} chunks"
        return None
    if turn.prompt == PERMISSION_PROMPT and (len(turn.chunks) > 1
                                             or any(c not in PERMISSION_ANSWERS for c in turn.chunks)):
        return f"turn {turn.turn_id} (/permission): chunks {turn.chunks[:4]!r}"
    return None


def ingest(tracked: Tracked, show: dict[str, Any]) -> list[str]:
    """Add one ``session show`` page (from ``tracked.cursor`` on) to what was seen; the chunk and
    turn violations it reveals."""
    problems: list[str] = []
    for turn in tracked.turns.values():
        turn.ended_before = turn.ended
    for t in show["turns"]:
        seen = tracked.turns.get(t["turn_id"])
        if seen is None:
            seen = tracked.turns[t["turn_id"]] = TurnSeen(t["turn_id"], t["prompt"])
        if t["state"] == "open":
            if seen.ended:
                problems.append(f"turn {seen.turn_id} ({seen.prompt}) ended {seen.stop_reason} and shows open again")
        elif seen.ended and seen.stop_reason != t["stop_reason"]:
            problems.append(f"turn {seen.turn_id} ({seen.prompt}) ended twice: {seen.stop_reason}, then "
                            f"{t['stop_reason']}")
        else:
            seen.ended, seen.stop_reason = True, t["stop_reason"]
    for entry in show["transcript"]:
        tracked.cursor = max(tracked.cursor, int(entry["cursor"]))
        if entry["kind"] != "agent_message_chunk":
            continue
        owner = tracked.turns.get(entry.get("turn_id") or "")
        if owner is None:
            problems.append(f"chunk {entry['text'][:40]!r} (cursor {entry['cursor']}) of a turn the session "
                            f"does not show ({entry.get('turn_id')})")
            continue
        if owner.ended_before:
            problems.append(f"turn {owner.turn_id} ({owner.prompt}): chunk {entry['text'][:40]!r} after it "
                            f"ended {owner.stop_reason}")
        owner.chunks.append(entry["text"])
    for turn in tracked.turns.values():
        if not turn.broken and (problem := _chunk_problem(turn)) is not None:
            turn.broken = True
            problems.append(problem)
    open_turns = [t.turn_id for t in tracked.turns.values() if not t.ended]
    if len(open_turns) > 1:
        problems.append(f"{len(open_turns)} open turns at once: {open_turns}")
    if open_turns and show["state"] != "RUNNING":
        problems.append(f"turn {open_turns[0]} open while the session is {show['state']}")
    return problems


def agent_groups(procs: list[dict[str, Any]]) -> set[int]:
    """Process groups with a live (not zombie) process in the control server's unit."""
    return {p["pgid"] for p in procs if p["unit"] == AGENTCTL_UNIT and p["state"] != "Z"}


def unsettled(status: dict[str, Any], tasks: list[dict[str, Any]], board: dict[str, list[str]],
              shows: dict[str, dict[str, Any]], procs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What is not (yet) true of this moment, by invariant: ``transitional``, ``truthful``,
    ``orphans``, ``board``."""
    out: dict[str, list[str]] = {"transitional": [], "truthful": [], "orphans": [], "board": []}
    groups = agent_groups(procs)
    server = (status.get("control_server") or {}).get("pid")
    accounted = {int(server)} if server else set()
    for sid, show in shows.items():
        if show["state"] in TRANSITIONAL:  # its agent may run before the session says live
            out["transitional"].append(f"session {sid} is {show['state']}")
            continue
        runs = bool(show.get("agent_pid")) and int(show["agent_pid"]) in groups
        if show["live"] != runs:
            out["truthful"].append(f"session {sid} shows live={show['live']} but its agent "
                                   f"{show.get('agent_pid')} {'runs' if runs else 'does not run'}")
        if show["live"] and show.get("agent_pid"):
            accounted.add(int(show["agent_pid"]))
        if any(p["state"] == "open" for p in show["permissions"]) and show["state"] != "RUNNING":
            out["truthful"].append(f"session {sid} shows an open permission request while {show['state']}")
    orphans = sorted(groups - accounted)
    if orphans and not out["transitional"]:  # a starting agent is accounted for once its session is live
        out["orphans"].append(f"process groups {orphans} in {AGENTCTL_UNIT} belong to no live session")
    strays = sorted({p["pid"] for p in procs if p["mock"] and p["unit"] != AGENTCTL_UNIT and p["state"] != "Z"})
    if strays:
        out["orphans"].append(f"mock agents {strays} outside {AGENTCTL_UNIT}")
    bucket_of = {task: bucket for bucket, ids in board.items() for task in ids}
    for task in tasks:
        latest = task["latest_session"]
        if latest is None or latest["session_id"] not in shows:
            continue
        show = shows[latest["session_id"]]
        ended = [t for t in show["turns"] if t["state"] != "open"]
        runs = bool(show.get("agent_pid")) and int(show["agent_pid"]) in groups
        expected, _ = placement(task["state"], show["state"], live=runs,
                                open_permission=any(p["state"] == "open" for p in show["permissions"]),
                                last_stop_reason=ended[-1]["stop_reason"] if ended else None)
        if bucket_of.get(task["task_id"]) != expected:
            out["board"].append(f"task {task['task_id']} is in {bucket_of.get(task['task_id'])} on the board, "
                                f"expected {expected} (session {show['state']}, agent "
                                f"{'runs' if runs else 'gone'})")
    return out
