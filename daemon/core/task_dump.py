"""What every asyncio task of a daemon is waiting on: a diagnostic for a daemon that seems hung.

Both daemons log this on SIGUSR1 (``systemctl kill --kill-whom=main -s USR1 kandev-backend``;
``--kill-whom=main`` matters: the default also signals the unit's other processes). Each task is
one log record: its name, state (``cancelling`` is the tell-tale of a swallowed cancellation) and
the whole chain of coroutines it is suspended in, innermost last. Python 3.11's own
``Task.print_stack`` shows only the outermost frame of that chain.

Only code locations are logged, never local variables, so no secret can leak through it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("kandev.task_dump")


def await_chain(task: asyncio.Task[Any]) -> list[str]:
    """``file:line in function`` for each coroutine ``task`` is suspended in, outermost first."""
    out: list[str] = []
    obj: Any = task.get_coro()
    seen = 0
    while obj is not None and seen < 100:
        seen += 1
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None) or getattr(obj, "ag_await", None)
    return out


def describe(task: asyncio.Task[Any]) -> str:
    state = "done" if task.done() else ("cancelling" if task.cancelling() else "pending")
    chain = await_chain(task)
    where = "\n    ".join(chain) if chain else "(not started)"
    return f"task {task.get_name()!r} {state}, awaiting:\n    {where}"


def log_tasks() -> None:
    """Log every task of the running loop (one record each), the current one included."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    log.warning("task dump requested (SIGUSR1): %d asyncio tasks", len(tasks))
    for task in tasks:
        log.warning("%s", describe(task))
