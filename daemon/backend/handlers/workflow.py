"""Handlers of the workflow ops ``workflow_set``, ``task_workflow`` and ``task_proceed``
(``api.RESUME_OPS``; ``kandev task create --steps``, ``kandev task workflow TASK_ID``,
``kandev task proceed TASK_ID``). The work is ``daemon.backend.sessions.workflow_runner``.
"""

from __future__ import annotations

from typing import Any

from daemon.backend.sessions.workflow_runner import WorkflowRunner
from daemon.store import workflow_steps as wf
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext, Handler


def handlers(runner: WorkflowRunner) -> dict[str, Handler]:
    async def op_workflow_set(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        try:
            steps = wf.parse_steps(args["steps"])
        except wf.WorkflowError as exc:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        return await runner.set_steps(args["task_id"], steps)

    async def op_task_workflow(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await runner.describe(args["task_id"])

    async def op_task_proceed(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await runner.proceed(args["task_id"])

    return {"workflow_set": op_workflow_set, "task_workflow": op_task_workflow, "task_proceed": op_task_proceed}
