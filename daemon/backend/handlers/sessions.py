"""Handlers of the session ops: ``session_start``, ``prompt``, ``cancel``, ``permission_respond``,
``session_show``, ``session_list`` (``api.TABLE``; the work is ``daemon.backend.sessions.sessions``)."""

from __future__ import annotations

from typing import Any

from daemon.backend.sessions.sessions import SessionService
from daemon.backend.views.session_view import PageRequest
from ipc.server import ConnectionContext, Handler


def handlers(sessions: SessionService) -> dict[str, Handler]:
    async def op_session_start(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.start(args["task_id"], args.get("agent", "mock"),
                                    passthrough=bool(args.get("passthrough", False)), prompt=args.get("prompt"))

    async def op_prompt(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.prompt(args["session_id"], args["text"], wait=bool(args.get("wait", False)))

    async def op_cancel(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.cancel(args["session_id"])

    async def op_permission_respond(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.respond_permission(args["session_id"], args["request_id"], args.get("option_id"))

    async def op_session_show(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.show(args["session_id"], PageRequest.from_args(args))

    async def op_session_list(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await sessions.list(detail=bool(args.get("detail")))

    return {
        "session_start": op_session_start,
        "prompt": op_prompt,
        "cancel": op_cancel,
        "permission_respond": op_permission_respond,
        "session_show": op_session_show,
        "session_list": op_session_list,
    }
