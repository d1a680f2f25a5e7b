"""Fault injection that exists in the product, off by default, so tests can break real processes at
exact steps.

Every fault is declared once, in ``FAULTS`` below: its name, its kind and what it is for. Production
code calls one line where the fault applies, and that line does nothing unless the fault is on:

- ``faults.hit(name)``: at a kill point the process SIGKILLs itself (the backend at each step of
  adoption, so tests can check that every crash point leaves a credential held by both sides; the
  control server at its start, for the crash-loop limit); at a failure the declared ``IpcError``
  is raised, so failed stops, failed reads and incompatible servers can be tested with real
  processes;
- ``await faults.delay(name)``: the step answers late (``name:seconds``), so the recovery
  deadline can be crossed on purpose;
- ``faults.active(name)``: for a fault that changes an answer rather than failing it.

A name that is not declared, or used as another kind, raises ``ValueError``: a misspelt fault is
a bug found by the first test that passes there, never a fault that silently never fires.

Switching faults on: ``$KANDEV_FAULT`` holds a comma-separated list (``name`` or
``name:seconds``); unset (always, in operation) means none. ``$KANDEV_FAULT_FILE`` may name a file
holding more (commas or newlines); unlike the variable, which a process reads from the environment
it started with, the file is read again at every check, so a test can switch a fault on or off for
processes already running (and the children they start later). A missing or unreadable file means
no fault. Nothing else reads these variables; operators never need them.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from enum import Enum

from daemon.core.journal import log_event
from ipc.errors import ErrorCode, IpcError

ENV = "KANDEV_FAULT"
FILE_ENV = "KANDEV_FAULT_FILE"


class FaultKind(Enum):
    KILL = "kill"  # hit(): SIGKILL this process
    FAIL = "fail"  # hit(): raise the declared IpcError
    DELAY = "delay"  # delay(): sleep the configured seconds
    ALTER = "alter"  # active(): the caller answers differently


@dataclass(frozen=True)
class Fault:
    name: str
    kind: FaultKind
    doc: str
    error: str | None = None  # FAIL: the error code answered (an ``ErrorCode``)
    message: str = ""  # FAIL: the error message answered


def _kill(name: str, doc: str) -> Fault:
    return Fault(name, FaultKind.KILL, doc)


def _fail(name: str, doc: str, error: str, message: str) -> Fault:
    return Fault(name, FaultKind.FAIL, doc, error, message)


_DECLARED = (
    _kill("adopt_after_rotate", "the backend, adopting: rotate accepted, nothing persisted yet"),
    _kill("adopt_after_secret", "the backend, adopting: new secret written, record not yet updated"),
    _kill("adopt_after_record", "the backend, adopting: secret and record durable, confirm not sent"),
    _kill("adopt_after_confirm", "the backend, adopting: confirmed, before re-tracking"),
    _kill("agentctl_dies_at_start", "the control server: launch file read, before it listens"),
    Fault("agentctl_slow_rotate", FaultKind.DELAY, "rotate answers late: an adoption in flight at the deadline"),
    Fault("agentctl_slow_enumeration", FaultKind.DELAY,
          "list_instances answers late: enumeration not complete at the deadline"),
    Fault("agentctl_slow_turn_statuses", FaultKind.DELAY,
          "turn_statuses answers late: the records' bulk turn-status read in flight at the deadline"),
    _fail("agentctl_stop_fails", "stop_instance answers an error (AC-EXECUTORS-SURVIVAL-002.15, AC-EXECUTORS-SURVIVAL-002.16)",
          ErrorCode.INTERNAL, "injected fault: stop_instance fails"),
    _fail("agentctl_turn_status_fails", "turn_status answers an error (AC-EXECUTORS-SURVIVAL-004.5)",
          ErrorCode.INTERNAL, "injected fault: turn_status fails"),
    _fail("agentctl_shutdown_fails", "ownership_shutdown answers an error (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7)",
          ErrorCode.INTERNAL, "injected fault: ownership_shutdown fails"),
    _fail("agentctl_lacks_shutdown", "ownership_shutdown answers as a server without the op (AC-EXECUTORS-CONTROL-OWNERSHIP-004.6)",
          ErrorCode.UNKNOWN_OP, "unknown op 'ownership_shutdown' (injected fault)"),
    _fail("agentctl_rotate_fails", "rotate answers an error: adoption incomplete (AC-EXECUTORS-CONTROL-OWNERSHIP-002.5)",
          ErrorCode.INTERNAL, "injected fault: rotate fails"),
    Fault("egress_test_resolver", FaultKind.ALTER,
          "the agents' egress proxy resolves every name ending in .test to 127.0.0.1 (Issue 44 scenario B)"),
    Fault("agentctl_lacks_turns", FaultKind.ALTER, "identify advertises no turns.v1 (AC-EXECUTORS-CONTROL-OWNERSHIP-004.3)"),
)
FAULTS: dict[str, Fault] = {f.name: f for f in _DECLARED}
if len(FAULTS) != len(_DECLARED):
    raise RuntimeError("a fault is declared twice")


def _declared(name: str, *kinds: FaultKind) -> Fault:
    fault = FAULTS.get(name)
    if fault is None:
        raise ValueError(f"unknown fault {name}")
    if fault.kind not in kinds:
        raise ValueError(f"fault {name} is a {fault.kind.value} fault, not {'/'.join(k.value for k in kinds)}")
    return fault


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
    """The faults switched on now: name -> the text after ``:`` (empty when none)."""
    out: dict[str, str] = {}
    text = os.environ.get(ENV, "") + "," + _file_text().replace("\n", ",")
    for item in text.split(","):
        name, _, value = item.strip().partition(":")
        if name:
            out[name] = value
    return out


def hit(name: str) -> None:
    """A kill point or a failure: SIGKILL this process, or raise the declared error, when ``name``
    is on; else nothing."""
    fault = _declared(name, FaultKind.KILL, FaultKind.FAIL)
    if name not in _entries():
        return
    if fault.kind is FaultKind.KILL:
        log_event("fault_injected", f"fault point {name}: killing this process", priority=4, FAULT=name)
        os.kill(os.getpid(), signal.SIGKILL)
        return
    assert fault.error is not None
    raise IpcError(fault.error, fault.message)


def delay_seconds(name: str) -> float:
    """Seconds the named step is delayed: 0 unless the fault is on as ``name:seconds``."""
    _declared(name, FaultKind.DELAY)
    try:
        return max(0.0, float(_entries().get(name, "0") or 0))
    except ValueError:
        return 0.0


async def delay(name: str) -> None:
    """Sleep as long as the delay fault ``name`` says (not at all when it is off)."""
    if seconds := delay_seconds(name):
        await asyncio.sleep(seconds)


def active(name: str) -> bool:
    """Whether the answer-altering fault ``name`` is on."""
    _declared(name, FaultKind.ALTER)
    return name in _entries()
