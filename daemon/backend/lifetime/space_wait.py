"""A full disk at backend start (Issue 21 item 5): reported and waited out, never a crash loop.

Opening the store needs a little space: an SQLite store in WAL mode cannot even be read when its
shared-memory index cannot be grown. When reading or opening the store fails for want of space,
the backend does not exit (systemd would restart it again and again). It logs
``store_out_of_space`` (with the path and the free bytes), tells systemd it is up with a status
saying so, and serves the CLI socket with ``status`` (backend state ``out_of_space`` and the
store's path and free bytes) and ``shutdown``; every other op gets the retryable error
``store_out_of_space``. Each time the free space grows (or every ``daemon.store.space.RETRY_S``) it
tries again; once the store opens, that server stops, handing its listening socket on
(``daemon.backend.lifetime.cli_listener``: the socket never disappears meanwhile), and the normal start goes
on: adoption, re-tracking, catching up on the events the control server kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.engine import make_url

from daemon.backend.lifetime.cli_listener import CliListener
from daemon.backend.lifetime.waiting_server import backend_status, serve_while
from daemon.core.service import Notifier, setup_daemon_logging
from daemon.host.paths import Paths
from daemon.store.db import sqlite_file
from daemon.store.space import SpaceWatch, free_bytes
from ipc import loop as event_loop
from ipc.errors import IpcError

T = TypeVar("T")
OUT_OF_SPACE = "out_of_space"


def when_space(paths: Paths, url: str, attempt: Callable[[], T], *, verbose: bool,
               service_gids: list[int], notifier: Notifier, listener: CliListener) -> T | None:
    """``attempt()``, again and again while it fails for want of space (serving ``status`` on
    ``listener`` meanwhile); None if the backend was told to stop while waiting. Other errors
    propagate."""
    watch = SpaceWatch(sqlite_file(make_url(url)) or paths.home)
    while True:
        try:
            return attempt()
        except Exception as exc:
            fresh = watch.state is None
            if fresh:
                setup_daemon_logging("backend", verbose=verbose)
            if not watch.failed(exc):
                raise
        if event_loop.run(_serve_while_full(paths, watch, service_gids, notifier, listener)):
            return None


async def _serve_while_full(paths: Paths, watch: SpaceWatch, gids: list[int], notifier: Notifier,
                            listener: CliListener) -> bool:
    """Serve ``status`` until the free space grows (False: the listener is handed on) or a stop is
    asked for (True: the socket is closed)."""

    def status() -> dict[str, Any]:
        path = Path(watch.state.path) if watch.state is not None and watch.state.path != "database.url" else None
        return {
            "backend": backend_status(paths, OUT_OF_SPACE),
            "store": {"path": str(path) if path else None, "bytes": None,
                      "free_bytes": free_bytes(path) if path else None, "out_of_space": watch.status()},
        }

    def refusal() -> IpcError:
        return IpcError("store_out_of_space", "the backend waits for space to open its store"
                        f" ({watch.state.path if watch.state else 'the store'}); free some space and retry", True)

    return await serve_while(paths, gids, notifier, listener, status=status, refusal=refusal,
                             why=f"store out of space: {watch.state.path if watch.state else '?'}; waiting for space",
                             until=watch.wait_for_space)
