"""Fault injection that exists in the product, off by default.

``$KANDEV_FAULT`` holds a comma-separated list of faults; unset (always, in
operation) means none. ``$KANDEV_FAULT_FILE`` may name a file holding more of
them (the same syntax; commas or newlines); unlike the variable, which a process
reads from the environment it started with, the file is read again at every
check, so a test can switch a fault on or off for processes that are already
running (and for the children they start later) without restarting them. A
missing or unreadable file means no fault. Three kinds:

- kill points (``fault_point``): the process SIGKILLs itself at an exact step:
  the backend at each step of adoption, so tests can check that every crash
  point leaves a credential held by both sides (docs/requirements.md#control-server-ownership,
  cross-cutting invariants); the control server at its start, so a server
  that crashes every time it is started can be tested (crash-loop limit);
- delays (``fault_delay``, written ``name:seconds``): a control-server step
  answers late, so the one recovery deadline can be crossed on purpose;
- failures (``fault_fails``): a control-server operation answers with an
  error, so failed stops, failed reads and incompatible servers can be tested
  with real processes.

Nothing else reads these variables; operators never need them.
"""

from __future__ import annotations

import os
import signal

from daemon.journal import log_event

ENV = "KANDEV_FAULT"
FILE_ENV = "KANDEV_FAULT_FILE"
POINTS = frozenset(
    {
        "adopt_after_rotate",  # rotate accepted, nothing persisted yet
        "adopt_after_secret",  # new secret written, record not yet updated
        "adopt_after_record",  # secret and record durable, confirm not sent
        "adopt_after_confirm",  # confirmed, before re-tracking
        "agentctl_dies_at_start",  # the control server, launch file read, before it listens
    }
)
DELAYS = frozenset(
    {
        "agentctl_slow_rotate",  # an adoption still in flight at the deadline
        "agentctl_slow_enumeration",  # enumeration not complete at the deadline
    }
)
FAILURES = frozenset(
    {
        "agentctl_stop_fails",  # stop_instance answers an error (AC-EXECUTORS-SURVIVAL-002.15, AC-EXECUTORS-SURVIVAL-002.16)
        "agentctl_turn_status_fails",  # turn_status answers an error (AC-EXECUTORS-SURVIVAL-004.5)
        "agentctl_lacks_turns",  # identify advertises no turns.v1 (AC-EXECUTORS-CONTROL-OWNERSHIP-004.3)
        "agentctl_shutdown_fails",  # ownership_shutdown answers an error (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7)
        "agentctl_lacks_shutdown",  # ownership_shutdown is an unknown op (AC-EXECUTORS-CONTROL-OWNERSHIP-004.6)
        "agentctl_rotate_fails",  # rotate answers an error: adoption incomplete (AC-EXECUTORS-CONTROL-OWNERSHIP-002.5)
    }
)


def _file_text() -> str:
    path = os.environ.get(FILE_ENV)
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(65536)
    except (OSError, ValueError):
        return ""


def _entries() -> dict[str, str]:
    out: dict[str, str] = {}
    text = os.environ.get(ENV, "") + "," + _file_text().replace("\n", ",")
    for item in text.split(","):
        name, _, value = item.strip().partition(":")
        if name:
            out[name] = value
    return out


def fault_point(name: str) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name}")
    if name in _entries():
        log_event("fault_injected", f"fault point {name}: killing this process", priority=4, FAULT=name)
        os.kill(os.getpid(), signal.SIGKILL)


def fault_delay(name: str) -> float:
    """Seconds the named step should be delayed: 0 unless ``$KANDEV_FAULT`` has ``name:seconds``."""
    if name not in DELAYS:
        raise ValueError(f"unknown fault delay {name}")
    try:
        return max(0.0, float(_entries().get(name, "0") or 0))
    except ValueError:
        return 0.0


def fault_fails(name: str) -> bool:
    if name not in FAILURES:
        raise ValueError(f"unknown fault {name}")
    return name in _entries()
