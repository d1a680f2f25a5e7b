"""Handlers of ``session_configure`` and ``session_reset_context`` (``api.RESUME_OPS``;
``kandev session configure`` and ``kandev session reset-context``).

The work is ``daemon.backend.sessions.runtime_settings`` and ``daemon.backend.sessions.context_reset``.
"""

from __future__ import annotations

from typing import Any

from daemon.backend.sessions.context_reset import ContextReset
from daemon.backend.sessions.runtime_settings import RuntimeSettings
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext, Handler


def handlers(settings: RuntimeSettings, resets: ContextReset) -> dict[str, Handler]:
    async def op_session_configure(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        options = args.get("options") or {}
        for key, value in options.items():
            if not isinstance(key, str) or not isinstance(value, (str, bool)):
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "options must map option ids to strings or booleans")
        return await settings.configure(args["session_id"], args.get("model"), args.get("mode"), options)

    async def op_session_reset_context(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await resets.reset_context(args["session_id"], restart=bool(args.get("restart", False)))

    return {"session_configure": op_session_configure, "session_reset_context": op_session_reset_context}
