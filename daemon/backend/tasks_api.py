"""Handlers of the task ops ``task_create`` and ``board`` (``api.TABLE``; the work is
``daemon.backend.tasks``)."""

from __future__ import annotations

from typing import Any

from daemon.backend.tasks import TaskService
from ipc.server import ConnectionContext, Handler


def handlers(tasks: TaskService) -> dict[str, Handler]:
    async def op_task_create(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await tasks.create(args["title"], args.get("executor", "local"), args.get("workspace"))

    async def op_board(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await tasks.board()

    return {"task_create": op_task_create, "board": op_board}
