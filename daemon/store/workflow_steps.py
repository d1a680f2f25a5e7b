"""Workflow steps: the smallest real workflow the context-reset rules need (RESETCFG-11).

A task may have an ordered list of named steps (table ``workflow_steps``). A
step may, on entry, **reset** the agent's context (a new provider session with
the runtime configuration restored, ``kandev session reset-context``) and then
send an automatic **prompt**. ``kandev task proceed TASK_ID`` leaves the
current step (``done``) and enters the next one (``active``), persisted before
its entry actions run; then the reset, then the prompt. A reset that fails
(e.g. the agent rejects a restored mode or option) leaves the step ``blocked``
and its prompt is never sent (RESETCFG-11).

The first step is entered when the steps are set (a task has no session yet
then, so its entry actions do not run; ``kandev session start --prompt`` is
the first prompt). A task without steps has no workflow.

Steps are written ``name[:reset][:prompt=TEXT]`` and separated by commas, e.g.
``plan,implement:reset:prompt=Implement the plan``; the prompt runs to the end
of its step, so it may hold ``:`` but not ``,``.

This module is pure data and store access; ``daemon.backend.handlers.resume`` runs
the entry actions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.store.models import WorkflowStep

MAX_STEPS = 32
MAX_PROMPT = 64 * 1024
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}$")


class WorkflowError(ValueError):
    """A workflow spec or move that is refused (the message says why)."""


@dataclass(frozen=True)
class StepSpec:
    name: str
    reset: bool = False
    prompt: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "reset": self.reset, "prompt": self.prompt}


def parse_steps(spec: str) -> list[StepSpec]:
    """``"plan,implement:reset:prompt=Implement it"`` -> steps; ``WorkflowError`` when malformed."""
    if not isinstance(spec, str) or not spec.strip():
        raise WorkflowError("no steps given (e.g. --steps 'plan,implement:reset:prompt=Implement it')")
    steps: list[StepSpec] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise WorkflowError(f"an empty step in {spec!r}")
        head, sep, prompt = part.partition(":prompt=")
        fields = [f.strip() for f in head.split(":")]
        name, flags = fields[0], fields[1:]
        reset = False
        for flag in flags:
            if flag == "reset":
                if reset:
                    raise WorkflowError(f"step {name!r}: 'reset' given twice")
                reset = True
            else:
                raise WorkflowError(f"step {name!r}: unknown flag {flag!r} (known: reset, prompt=TEXT)")
        text = prompt.strip() if sep else None
        if sep and not text:
            raise WorkflowError(f"step {name!r}: prompt= needs a text")
        steps.append(StepSpec(name=name, reset=reset, prompt=text))
    return validate_steps(steps)


def validate_steps(steps: Sequence[StepSpec]) -> list[StepSpec]:
    if not steps:
        raise WorkflowError("a workflow needs at least one step")
    if len(steps) > MAX_STEPS:
        raise WorkflowError(f"at most {MAX_STEPS} steps, not {len(steps)}")
    seen: set[str] = set()
    for step in steps:
        if not _NAME.match(step.name):
            raise WorkflowError(
                f"step name {step.name!r}: 1..64 letters, digits, spaces, '_', '.' or '-', starting with"
                " a letter or digit"
            )
        if step.name in seen:
            raise WorkflowError(f"step name {step.name!r} is used twice")
        seen.add(step.name)
        if step.prompt is not None and (len(step.prompt) > MAX_PROMPT or "\0" in step.prompt):
            raise WorkflowError(f"step {step.name!r}: the prompt is too long or holds NUL")
    return list(steps)


def load_steps(db: Session, task_id: str) -> list[WorkflowStep]:
    return list(db.scalars(select(WorkflowStep).where(WorkflowStep.task_id == task_id)
                           .order_by(WorkflowStep.position)))


def set_steps(db: Session, task_id: str, steps: Sequence[StepSpec], now: datetime | None = None) -> None:
    """Give a task its steps; the first is entered at once. Refused when it already has some."""
    if load_steps(db, task_id):
        raise WorkflowError(f"task {task_id} already has workflow steps")
    when = now or datetime.now(UTC)
    for i, step in enumerate(validate_steps(steps)):
        db.add(WorkflowStep(
            task_id=task_id, position=i, name=step.name, reset_context=step.reset, prompt=step.prompt,
            status="active" if i == 0 else "pending", detail="entered (first step)" if i == 0 else None,
            entered_at=when if i == 0 else None,
        ))
    db.flush()


def current(steps: Sequence[WorkflowStep]) -> WorkflowStep | None:
    """The step the task is in (``active`` or ``blocked``)."""
    for step in steps:
        if step.status in ("active", "blocked"):
            return step
    return None


def next_step(steps: Sequence[WorkflowStep]) -> WorkflowStep:
    """The step ``proceed`` enters; ``WorkflowError`` when there is none."""
    if not steps:
        raise WorkflowError("the task has no workflow steps (kandev task create --steps ...)")
    here = current(steps)
    position = -1 if here is None else here.position
    later = [s for s in steps if s.position > position]
    if not later:
        raise WorkflowError(f"the task is at its last step {here.name!r}" if here else "no step to enter")
    return later[0]


def enter(db: Session, steps: Sequence[WorkflowStep], target: WorkflowStep, now: datetime | None = None) -> None:
    """Leave the current step (``done``) and enter ``target`` (``active``): persisted by the caller's
    commit, before the entry actions run."""
    when = now or datetime.now(UTC)
    for step in steps:
        if step.position < target.position and step.status != "done":
            step.status = "done"
    target.status = "active"
    target.entered_at = when
    target.detail = "entering"
    db.flush()


def describe(steps: Sequence[WorkflowStep]) -> list[dict[str, Any]]:
    return [
        {"position": s.position, "name": s.name, "reset": bool(s.reset_context), "prompt": s.prompt,
         "status": s.status, "detail": s.detail,
         "entered_at": s.entered_at.isoformat() if s.entered_at else None}
        for s in steps
    ]
