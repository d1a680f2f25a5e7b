"""Liveness of a recovery-inventory row: live, dead or unknown (AC-EXECUTORS-SURVIVAL-003.6).

A row is live only if *its own* instance is present — never because the shared
control server runs. Which evidence counts depends on where the row came from
and on what this backend did with the recorded server:

- capability disabled, or nothing answered at the recorded endpoint (or none
  was recorded): today's process-identifier probe (pid + start: the boot id and
  start ticks of ``daemon.host.process_start.stamp``, which no step of the wall clock
  moves; a row from before they were recorded: the wall-clock start time);
- a server answered but this backend did not adopt it: ``unknown`` for every
  inherited row — the survivor runs where we are not looking;
- adopted (or, for rows this backend created, the server it uses): presence
  in one enumeration taken *after* every record reached its recovery outcome;
  a row whose stop was still in flight when it was taken is ``unknown``.

Within one reconciliation pass a single enumeration is shared (``Scope``);
a classification outside a pass enumerates for itself, and before recovery
finished it is ``unknown`` at once without enumerating or waiting. Unknown rows
are left untouched: neither repaired nor treated as live (docs/architecture.md#startup-recovery-step-by-step).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import psutil

from daemon.backend.state.agent_identity import AgentIdentity
from daemon.host import process_start

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


def _started_as_recorded(proc: psutil.Process, agent: AgentIdentity) -> bool:
    """Whether ``proc`` is the process recorded: by its stamp where one was recorded, else by its
    wall-clock start time (nothing recorded: yes). Raises ``psutil.NoSuchProcess`` when it is gone,
    another ``psutil.Error`` or ``OSError`` when /proc cannot tell."""
    if agent.start_stamp is not None:
        now = process_start.stamp(proc.pid)
        if now is None:
            raise psutil.NoSuchProcess(proc.pid)
        return now == agent.start_stamp
    return agent.start_time is None or abs(proc.create_time() - agent.start_time) <= 0.01


def pid_probe(agent: AgentIdentity) -> str:
    """Today's probe: the recorded process still exists and started when recorded."""
    if not agent.pid:
        return DEAD
    try:
        proc = psutil.Process(agent.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return DEAD
        if not _started_as_recorded(proc, agent):
            return DEAD  # the pid was reused by another process
        return LIVE
    except psutil.NoSuchProcess:
        return DEAD
    except (psutil.Error, OSError):
        return UNKNOWN


def classify(*, instance_id: str, agent: AgentIdentity, created_by_boot: str | None, scope: Scope) -> str:
    if scope.disabled:
        return pid_probe(agent)
    if instance_id in scope.stops_in_flight:
        return UNKNOWN
    ours = scope.created_by_us is not None and created_by_boot == scope.created_by_us
    if not ours and not scope.adopted:
        if scope.answered:
            return UNKNOWN
        return pid_probe(agent)
    if scope.enumeration is None:
        return UNKNOWN
    return LIVE if instance_id in scope.enumeration else DEAD


def live_groups() -> set[int]:
    """Every process-group id with at least one process that is not a zombie (one pass over /proc)."""
    groups: set[int] = set()
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                groups.add(os.getpgid(proc.pid))
        except (OSError, psutil.Error):
            continue
    return groups


def stop_leftover_group(agent: AgentIdentity, groups: set[int] | None = None) -> str:
    """After its control server died: make sure nothing of an agent's process group remains.

    Returns ``gone`` (nothing of it left), ``killed`` (SIGKILL sent to its group) or ``unknown``
    (its identity could not be checked, so nothing was signalled). Every agent leads its own process
    group (``start_new_session``), so its pgid is its pid. The leader alive is signalled only if
    its start matches (its stamp where recorded, else its wall-clock start); the leader gone, Linux
    never hands out a pid that is still in use as a process-group id, so a group with that id is
    the agent's, unless another process now owns the pid (then the agent's group is empty), or
    the stamp says it ran before a reboot. The same rule the control server applies to its agents.
    ``groups``: ``live_groups()`` taken once for many agents (else taken here).
    """
    pid = agent.pid
    if not pid:
        return "gone"
    try:
        if agent.start_stamp is not None and not process_start.of_this_boot(agent.start_stamp):
            return "gone"  # it ran before a reboot: nothing of it is left, the pid is another's
        leader = psutil.Process(pid)
        if agent.start_time is None and agent.start_stamp is None:
            return "unknown"  # a process holds the pid, and nothing says whether it is the agent
        if not _started_as_recorded(leader, agent):
            return "gone"  # the pid is another process's now: the agent and its group are gone
    except psutil.NoSuchProcess:
        pass
    except (psutil.Error, OSError):
        return "unknown"
    if pid not in (live_groups() if groups is None else groups):
        return "gone"  # at most zombies left (the leader killed with its server, not yet reaped)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "unknown"
    return "killed"

