"""Handlers of the task ops ``task_create``, ``task_done`` and ``task_reopen`` (``api.TABLE``; the work
is ``daemon.backend.tasks.tasks``; ``board`` is a view: ``daemon.backend.views.lists``)."""

from __future__ import annotations

from typing import Any

from daemon.backend.tasks.tasks import TaskService
from ipc.server import ConnectionContext, Handler


def handlers(tasks: TaskService) -> dict[str, Handler]:
    async def op_task_create(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await tasks.create(args["title"], args.get("executor", "local"), args.get("workspace"))

    async def op_task_done(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await tasks.done(args["task_id"])

    async def op_task_reopen(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await tasks.reopen(args["task_id"])

    return {"task_create": op_task_create, "task_done": op_task_done, "task_reopen": op_task_reopen}
