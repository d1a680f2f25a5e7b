"""The CLI socket while the backend waits to open its store (a full disk, an unreachable database
server): ``status`` and ``shutdown`` answered, every other op refused with a retryable error.

``serve_while`` starts that server on the CLI listener (``daemon.backend.lifetime.cli_listener``),
tells systemd the backend is up with a status saying what it waits for, keeps the watchdog fed
(the unit's ``WatchdogSec=`` holds while waiting too: a wait longer than it must not read as a hung
backend), and runs ``until`` (what ends the wait). Then the server stops: handing its listening
socket on when the wait is over, closing it when a stop was asked for or ``until`` failed (its
error propagates: the caller says why the backend cannot start).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import Any

from daemon.api import ops as api
from daemon.backend.lifetime.cli_listener import CliListener
from daemon.core.limits import BUFFER_LIMIT, IDLE_CONNECTION_TIMEOUT_S
from daemon.core.service import Notifier, install_signal_handlers, watched
from daemon.core.version import VERSION
from daemon.host.paths import Paths
from ipc.errors import IpcError
from ipc.server import ConnectionContext, Handler, IpcServer


def backend_status(paths: Paths, state: str) -> dict[str, Any]:
    """``status``'s ``backend`` part while waiting: this process, and ``state`` saying what it waits for."""
    return {"pid": os.getpid(), "version": VERSION, "socket": str(paths.backend_socket), "home": str(paths.home),
            "state": state}


async def serve_while(paths: Paths, gids: list[int], notifier: Notifier, listener: CliListener, *,
                      status: Callable[[], dict[str, Any]], refusal: Callable[[], IpcError], why: str,
                      until: Callable[[], Coroutine[Any, Any, Any]]) -> bool:
    """Serve ``status`` until ``until()`` returns (False: the listener is handed on) or a stop is
    asked for (True: the socket is closed). ``why``: systemd's status line meanwhile."""
    stop = asyncio.Event()
    install_signal_handlers(asyncio.get_running_loop(), stop=stop.set)

    async def op_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return status()

    async def op_shutdown(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        stop.set()
        return {"ok": True, "detach": True}

    async def refused(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
        raise refusal()

    handlers: dict[str, Handler] = {name: refused for name in api.TABLE.names}
    handlers.update(status=op_status, shutdown=op_shutdown)
    server = IpcServer(paths.backend_socket, api.TABLE, handlers, allowed_gids=gids, socket_mode=0o660,
                       idle_timeout=IDLE_CONNECTION_TIMEOUT_S, buffer_limit=BUFFER_LIMIT,
                       accept_json=True)  # the kandev CLI speaks JSON (ipc.codec_json)
    await listener.serve(server)
    notifier.ready(why)
    handed_on = False
    try:
        async with watched(notifier):
            waiting = asyncio.ensure_future(until())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
            for task in (waiting, stopping):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task  # the wait's own error, if it failed, propagates from here
        if not stop.is_set():
            await listener.hand_over(server)
            handed_on = True
    finally:
        if not handed_on:
            await server.close()
    return stop.is_set()
