"""The control server's settings at its start: ``validate_agentctl`` checks the values the backend
hands it (numbers, or ``format_duration`` spellings) and resolves the unowned period
(``resolve_unowned_period``: the idle-timeout ordering and the 1 min floor, adjusted and recorded,
AC-EXECUTORS-CONTROL-OWNERSHIP-003.4, AC-EXECUTORS-CONTROL-OWNERSHIP-003.6,
AC-EXECUTORS-CONTROL-OWNERSHIP-003.7). The keys themselves are declared in ``daemon.config.keys``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from daemon.config.keys import (
    UNOWNED_PERIOD_FLOOR,
    Kind,
    Where,
    check_range,
    convert,
    format_duration,
    render_value,
)


@dataclass(frozen=True)
class ResolvedAgentctl:
    """The control server's settings after validation; ``notes`` are adjustments to log."""

    detached_event_limit: int
    unowned_period: float
    idle_timeout: float
    notes: list[str]


def resolve_unowned_period(period: float, idle_timeout: float) -> tuple[float, list[str]]:
    """Apply the idle-timeout ordering and the 1 min floor; return the period and what changed.

    AC-EXECUTORS-CONTROL-OWNERSHIP-003.4: with reaping on (idle > 0) the period
    must be shorter than the idle timeout, else it becomes idle/2. AC-EXECUTORS-CONTROL-OWNERSHIP-003.6: with
    reaping off (idle <= 0) the period is used unchanged. AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: then at least
    1 min, even if that breaks the ordering (recorded, and the server starts).
    """
    notes: list[str] = []
    effective = period
    if idle_timeout > 0 and effective >= idle_timeout:
        effective = idle_timeout / 2
        notes.append(
            f"agentctl.unowned_period {format_duration(period)} is not shorter than agentctl.idle_timeout"
            f" {format_duration(idle_timeout)}: using half the idle timeout, {format_duration(effective)}"
            " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.4)"
        )
    if effective < UNOWNED_PERIOD_FLOOR:
        notes.append(
            f"agentctl.unowned_period {format_duration(effective)} is below the 1min floor: using 1min"
            " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.7)"
        )
        effective = UNOWNED_PERIOD_FLOOR
        if idle_timeout > 0 and effective >= idle_timeout:
            notes.append(
                f"the ordering unowned_period < idle_timeout ({format_duration(idle_timeout)}) cannot be met"
                " together with the 1min floor: using 1min anyway; the idle reaper may stop instances first"
                " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.7)"
            )
    return effective, notes


def _agentctl_value(kind: Kind, key: str, value: Any, origin: str | None) -> tuple[Any, str]:
    """A control-server value (number, or text as handed over) and its rendering for messages."""
    where = Where(f"agentctl.{key}", origin)
    if kind is not Kind.INT and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise where.error(render_value(value), "is not a duration")
        return float(value), json.dumps(format_duration(float(value)))
    return convert(kind, value, where, text=True), render_value(value)


def validate_agentctl(
    detached_event_limit: int | float | str,
    unowned_period: float | str,
    idle_timeout: float | str,
    *,
    origins: Mapping[str, str] | None = None,
) -> ResolvedAgentctl:
    """Check and resolve the control server's keys at its start.

    Values may be numbers (seconds) or the strings the backend hands over
    (``format_duration`` spellings). ``origins`` maps a dotted key to ``env
    NAME`` or a file, for messages. AC-EXECUTORS-SURVIVAL-001.8: the limit is a
    whole number in 1..10000, else refused (never clamped).
    """
    o = origins or {}
    limit, limit_given = _agentctl_value(Kind.INT, "detached_event_limit", detached_event_limit,
                                         o.get("agentctl.detached_event_limit"))
    check_range("agentctl.detached_event_limit", limit, limit_given, o.get("agentctl.detached_event_limit"))
    idle, _ = _agentctl_value(Kind.DURATION_OR_ZERO, "idle_timeout", idle_timeout,
                              o.get("agentctl.idle_timeout"))
    period, period_given = _agentctl_value(Kind.DURATION, "unowned_period", unowned_period,
                                           o.get("agentctl.unowned_period"))
    check_range("agentctl.unowned_period", period, period_given, o.get("agentctl.unowned_period"))
    resolved, notes = resolve_unowned_period(period, idle)
    return ResolvedAgentctl(limit, resolved, idle, notes)
