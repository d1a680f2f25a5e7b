"""daemon.store.workflow_steps: step specs, storage and moves (the entry actions run in resume_api)."""

from __future__ import annotations

import pytest

from daemon.store import workflow_steps as wf
from daemon.store.db import Store
from daemon.store.models import Task


def test_parse_steps() -> None:
    steps = wf.parse_steps("plan, implement:reset:prompt=Implement it: all of it ,review:prompt=Review")
    assert [s.to_json() for s in steps] == [
        {"name": "plan", "reset": False, "prompt": None},
        {"name": "implement", "reset": True, "prompt": "Implement it: all of it"},
        {"name": "review", "reset": False, "prompt": "Review"},
    ]


@pytest.mark.parametrize("spec, message", [
    ("", "no steps"),
    ("a,,b", "empty step"),
    ("a:frobnicate", "unknown flag"),
    ("a:reset:reset", "twice"),
    ("a:prompt=", "needs a text"),
    ("a,a", "used twice"),
    ("-x", "step name"),
    (",".join(f"s{i}" for i in range(wf.MAX_STEPS + 1)), "at most"),
])
def test_parse_steps_refusals(spec: str, message: str) -> None:
    with pytest.raises(wf.WorkflowError, match=message):
        wf.parse_steps(spec)


def test_steps_enter_in_order_and_persist(store: Store) -> None:
    with store.session() as db:
        task = Task(title="t")
        db.add(task)
        db.flush()
        task_id = task.id
        wf.set_steps(db, task_id, wf.parse_steps("plan,implement:reset:prompt=go,review"))
    with store.session() as db:
        steps = wf.load_steps(db, task_id)
        assert [(s.name, s.status) for s in steps] == [("plan", "active"), ("implement", "pending"),
                                                       ("review", "pending")]
        assert wf.current(steps).name == "plan"
        target = wf.next_step(steps)
        assert (target.name, target.reset_context, target.prompt) == ("implement", True, "go")
        wf.enter(db, steps, target)
    with store.session() as db:
        steps = wf.load_steps(db, task_id)
        assert [s.status for s in steps] == ["done", "active", "pending"]
        steps[1].status = "blocked"  # a failed entry action: still the current step
    with store.session() as db:
        steps = wf.load_steps(db, task_id)
        assert wf.current(steps).name == "implement"
        wf.enter(db, steps, wf.next_step(steps))
    with store.session() as db:
        steps = wf.load_steps(db, task_id)
        assert [s.status for s in steps] == ["done", "done", "active"]
        with pytest.raises(wf.WorkflowError, match="last step"):
            wf.next_step(steps)
        with pytest.raises(wf.WorkflowError, match="already has"):
            wf.set_steps(db, task_id, wf.parse_steps("x"))
    with store.session() as db, pytest.raises(wf.WorkflowError, match="no workflow steps"):
        wf.next_step(wf.load_steps(db, "no-such-task"))
