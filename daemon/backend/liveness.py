"""Liveness of a recovery-inventory row: live, dead or unknown (AC-EXECUTORS-SURVIVAL-003.6).

A row is live only if *its own* instance is present — never because the shared
control server runs. Which evidence counts depends on where the row came from
and on what this backend did with the recorded server:

- capability disabled, or nothing answered at the recorded endpoint (or none
  was recorded): today's process-identifier probe (pid + start time);
- a server answered but this backend did not adopt it: ``unknown`` for every
  inherited row — the survivor runs where we are not looking;
- adopted (or, for rows this backend created, the server it uses): presence
  in one enumeration taken *after* every record reached its recovery outcome;
  a row whose stop was still in flight when it was taken is ``unknown``.

Within one reconciliation pass a single enumeration is shared (``Scope``);
a classification outside a pass enumerates for itself, and before recovery
finished it is ``unknown`` at once without enumerating or waiting. Unknown rows
are left untouched: neither repaired nor treated as live (design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

LIVE, DEAD, UNKNOWN = "live", "dead", "unknown"


@dataclass
class Scope:
    """What one reconciliation pass knows. ``enumeration``: instance ids present, or None."""

    disabled: bool
    adopted: bool
    answered: bool  # a server answered at the recorded endpoint
    enumeration: set[str] | None = None
    stops_in_flight: set[str] = field(default_factory=set)
    created_by_us: str | None = None  # this backend's boot id (rows it created itself)


def pid_probe(pid: int | None, start_time: float | None) -> str:
    """Today's probe: the recorded process still exists with the recorded start time."""
    if not pid:
        return DEAD
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return DEAD
        if start_time is not None and abs(proc.create_time() - start_time) > 0.01:
            return DEAD  # the pid was reused by another process
        return LIVE
    except psutil.NoSuchProcess:
        return DEAD
    except psutil.Error:
        return UNKNOWN


def classify(
    *,
    instance_id: str,
    agent_pid: int | None,
    agent_pid_start_time: float | None,
    created_by_boot: str | None,
    scope: Scope,
) -> str:
    if scope.disabled:
        return pid_probe(agent_pid, agent_pid_start_time)
    if instance_id in scope.stops_in_flight:
        return UNKNOWN
    ours = scope.created_by_us is not None and created_by_boot == scope.created_by_us
    if not ours and not scope.adopted:
        if scope.answered:
            return UNKNOWN
        return pid_probe(agent_pid, agent_pid_start_time)
    if scope.enumeration is None:
        return UNKNOWN
    return LIVE if instance_id in scope.enumeration else DEAD
