"""The reload ops (Issue 15): thin handlers over ``daemon.agentctl.reload.reexec`` and ``reload_status``.

``reload`` (authenticated) starts a re-exec of the installed code with this server's state handed
over; ``server_info`` reports the running version, the pid and the reload history (the same
document as the status file beside the socket). ``identify`` reports nothing of this
(AC-EXECUTORS-CONTROL-OWNERSHIP-001.11: three things and no path).
"""

from __future__ import annotations

import os
from typing import Any

from daemon.agentctl.reload import status as reload_status
from daemon.agentctl.server_context import ServerContext
from daemon.core.version import VERSION
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.server import Handler


def handlers(server: ServerContext) -> dict[str, Handler]:
    """The reload ops' handlers."""

    def reload(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        server.refuse_if_shutting_down("reload")
        if server.reloader is None:
            raise IpcError(ErrorCode.CONFLICT, "reload: this server was started without re-exec support")
        attempt = server.reloader.request(f"reload op from pid {ctx.peer.pid}")
        return {"attempt": attempt, "version": VERSION, "pid": os.getpid()}

    def server_info(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return reload_status.status(server)

    return {"reload": reload, "server_info": server_info}
