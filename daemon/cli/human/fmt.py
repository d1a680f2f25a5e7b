"""Small formatting rules shared by every human view: short ids, ages, state colours."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from daemon.cli.human.term import Colour
from daemon.store.states import SessionState, TurnState

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the CLI's import budget)
if TYPE_CHECKING:
    from typing import Any

SHORT = 8
"""Characters of an id shown to people (any unique prefix of 4 or more is accepted back)."""


def short(ident: str | None, length: int = SHORT) -> str:
    return "-" if not ident else ident[:length]


def unique_length(ids: Iterable[str], minimum: int = SHORT) -> int:
    """The shortest prefix length >= ``minimum`` that tells all of ``ids`` apart."""
    shown = sorted(set(ids))
    length = minimum
    for a, b in zip(shown, shown[1:], strict=False):
        common = 0
        while common < min(len(a), len(b)) and a[common] == b[common]:
            common += 1
        length = max(length, common + 1)
    return length


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def when(text: str | None) -> str:
    """An ISO timestamp for people: to the second, in UTC (``2026-12-06 23:55:25Z``; "-" when unknown)."""
    moment = parse_time(text)
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def age(text: str | None, now: datetime | None = None) -> str:
    """``kubectl``-style age of an ISO timestamp: 45s, 3m, 2h, 5d ("-" when unknown)."""
    when = parse_time(text)
    if when is None:
        return "-"
    seconds = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 2 * 3600:
        return f"{seconds // 60}m"
    if seconds < 2 * 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def duration_ms(ms: float | int | None) -> str:
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms"
    return f"{ms / 1000:.1f} s"


_STATE_COLOURS: dict[str, tuple[Colour, ...]] = {
    SessionState.RUNNING: (Colour.GREEN,),
    SessionState.WAITING_FOR_INPUT: (Colour.CYAN,),
    SessionState.STARTING: (Colour.YELLOW,),
    SessionState.CREATED: (Colour.DIM,),
    SessionState.FAILED: (Colour.RED,),
    SessionState.CANCELLED: (Colour.YELLOW,),
    SessionState.COMPLETED: (Colour.DIM,),
}


def state_styles(state: str | None) -> tuple[Colour, ...]:
    return _STATE_COLOURS.get(state or "", ())


NO_AGENT = "NO AGENT"
"""A session's state as people see it when the store says it runs or waits for input but no agent is
there to answer (stopped with ``session stop``, or lost in a backend restart): ``kandev resume``
gives it one."""


def session_state(state: str | None, live: bool | None,
                  host: dict[str, Any] | None = None) -> tuple[str, tuple[Colour, ...]]:
    """A session's state as every view shows it (``session list``, the board): the stored state,
    or ``NO_AGENT`` where it runs or waits for input without an agent (``live`` False). A session of
    a cluster host that is not ready (``host``: the session's ``host`` and ``host_state``) shows its
    last known state marked so, e.g. ``RUNNING (host b unreachable)``: never as live."""
    host_state = (host or {}).get("host_state")
    if host_state not in (None, "ready"):
        return f"{state or '-'} (host {host.get('host') if host else '-'} {host_state})", (Colour.YELLOW,)
    if state in (SessionState.RUNNING, SessionState.WAITING_FOR_INPUT) and live is False:
        return NO_AGENT, (Colour.YELLOW,)
    return state or "-", state_styles(state)


def with_host(headers: list[str], rows: list[list[Any]], hosts: list[str | None], at: int) -> None:
    """A HOST column at ``at`` (Issue 47): in a cluster only (some row has a host)."""
    if not any(hosts):
        return
    headers.insert(at, "HOST")
    for row, host in zip(rows, hosts, strict=True):
        row.insert(at, host or "-")


def yes_no(value: object) -> str:
    return "yes" if value else "no"


def stop_reason_ok(state: str | None, stop_reason: str | None, error: str | None = None) -> bool:
    """Whether a turn ended normally (``end_turn``, no error)."""
    return state == TurnState.FINISHED and stop_reason == "end_turn" and not error


def quiet_text(quiet: dict[str, object]) -> str:
    """``waiting for the agent: no output for 45 s``: a running turn whose agent is silent (the
    ``quiet`` object of follow, the board and ``session show``)."""
    text = f"waiting for the agent: no output for {quiet.get('seconds')} s"
    if quiet.get("timed_out"):
        text += " (agents.turn_timeout_s passed: the turn is being cancelled)"
    return text


def quiet_hint(quiet: dict[str, object]) -> str:
    """What to look at about a silent agent: its log, the provider address it was given, the cancel."""
    parts = [f"`{quiet.get('logs')}` shows what it wrote"]
    if quiet.get("provider"):
        parts.append(f"it was given {quiet['provider']}")
    parts.append(f"`{quiet.get('cancel')}` ends the turn")
    return "; ".join(parts)


def out_of_space_line(full: dict[str, Any]) -> str:
    """The sentence ``kandev status`` and the board's header show while the store or the home is out
    of space (``store.out_of_space``)."""
    if full.get("cause") == "no_free_space":
        why = "agents' writes there wait for space, so their turns stall"
    else:
        why = "agents' output waits with the control server"
    return (f"out of space: {full.get('path')} ({full.get('free_bytes')} bytes free): {why}; free some space"
            " and everything goes on (nothing is lost)")


def unreachable_line(gone: dict[str, Any]) -> str:
    """The sentence ``kandev status`` shows while the database server cannot be reached
    (``store.unreachable``)."""
    since = gone.get("since")
    when = (datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            if isinstance(since, (int, float)) else "?")
    seconds = gone.get("seconds")
    lasting = f" ({seconds:.0f} s)" if isinstance(seconds, (int, float)) else ""
    return (f"store unreachable since {when}{lasting}: the database server (database.url) does not answer"
            f" ({gone.get('detail') or 'no detail'}); agents keep running and their output waits with the"
            " control server; everything goes on once it is back (nothing is lost)")


def network_refusals(net: dict[str, Any] | None) -> str | None:
    """An agent's (or every agent's) network refusals in one line: the mode, how many requests its
    egress proxy refused and the last few destinations (the agent named them: escaped)."""
    if not net:
        return None
    from daemon.cli.human.visible import visible

    count = int(net.get("refused") or 0)
    mode = f"{net['mode']}; " if net.get("mode") else ""
    recent = net.get("recent_refused") or []
    last = ", ".join(visible(f"{_host_port(r)} ({r.get('reason')})") for r in recent[::-1])
    return f"{mode}{count} request{'' if count == 1 else 's'} refused" + (f", last: {last}" if last else "")


def _host_port(refused: dict[str, Any]) -> str:
    host = str(refused.get("host"))
    return f"[{host}]:{refused.get('port')}" if ":" in host else f"{host}:{refused.get('port')}"
