"""Fault injection points that exist in the product, off by default.

``fault_point(name)`` does nothing unless ``$KANDEV_FAULT`` names that point,
in which case the process SIGKILLs itself there. Tests use it to stop a
backend at an exact step of adoption (e.g. after ``rotate`` was accepted and
before ``confirm``) and check that every crash point leaves a credential held
by both sides (spec/ownership.md, cross-cutting invariants). Nothing else
reads this variable; operators never need it.
"""

from __future__ import annotations

import os
import signal

from daemon.journal import log_event

ENV = "KANDEV_FAULT"
# Delays, set as ``KANDEV_FAULT=<name>:<seconds>``; read by the control server.
DELAYS = frozenset(
    {
        "agentctl_slow_rotate",  # rotate answers late: an adoption still in flight at the deadline
        "agentctl_slow_enumeration",  # list_instances answers late: enumeration not complete at the deadline
    }
)
POINTS = frozenset(
    {
        "adopt_after_rotate",  # rotate accepted, nothing persisted yet
        "adopt_after_secret",  # new secret written, record not yet updated
        "adopt_after_record",  # secret and record durable, confirm not sent
        "adopt_after_confirm",  # confirmed, before re-tracking
    }
)


def fault_point(name: str) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name}")
    if os.environ.get(ENV) == name:
        log_event("fault_injected", f"fault point {name}: killing this process", priority=4, FAULT=name)
        os.kill(os.getpid(), signal.SIGKILL)


def fault_delay(name: str) -> float:
    """Seconds the named step should be delayed: 0 unless ``$KANDEV_FAULT`` is ``name:seconds``."""
    if name not in DELAYS:
        raise ValueError(f"unknown fault delay {name}")
    point, _, seconds = os.environ.get(ENV, "").partition(":")
    if point != name:
        return 0.0
    try:
        return max(0.0, float(seconds))
    except ValueError:
        return 0.0
