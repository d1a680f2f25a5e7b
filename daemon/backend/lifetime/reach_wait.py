"""A database server that cannot be reached at backend start (Issue 47 item 5): waited for, never a
crash loop.

A backend whose PostgreSQL store (``database.url``) is down when it starts (the database host
rebooting with the rest, a failover under way) does not exit for systemd to start it again every
second. Its first contact with the server (taking the store's lock) fails as unreachable
(``daemon.store.reach.is_unreachable``): it logs ``store_unreachable`` once, tells systemd it is up
with a status saying it waits for the database server, and serves the CLI socket
(``daemon.backend.lifetime.waiting_server``): ``status`` (backend state ``store_unreachable``,
``store.reachable: false`` with since when, the last error and the attempts) and ``shutdown``;
every other op gets the retryable ``store_unreachable``. It tries again with the store's own
backoff (``daemon.store.reach.next_delay``: up to every ``MAX_RETRY_S`` s); the first attempt that
succeeds logs ``store_reachable`` with how long it lasted and the normal start goes on (adoption
of the surviving control server, re-tracking, the events it kept). An attempt that fails for
another reason (another backend holds the store's lock), or a connection the server answered and
refused (a wrong password, an unknown role or database: ``daemon.store.reach.refused_connection``),
ends the wait with that error: the backend exits saying why, as before.

A SQLite store is a file: nothing it raises is "unreachable", so this never waits for one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from daemon.api.ops import BackendState
from daemon.backend.lifetime.cli_listener import CliListener
from daemon.backend.lifetime.waiting_server import backend_status, serve_while
from daemon.core.service import Notifier, setup_daemon_logging
from daemon.host.paths import Paths
from daemon.store.reach import WHERE, ReachWatch, is_unreachable, next_delay, refused_connection
from ipc import loop as event_loop
from ipc.errors import IpcError

STORE_UNREACHABLE = "store_unreachable"
"""The retryable error every op but ``status`` and ``shutdown`` gets meanwhile."""


def _an_outage(exc: Exception) -> bool:
    """Whether a failed attempt is worth waiting out: the server could not be reached, and did not
    answer to refuse the connection."""
    return is_unreachable(exc) and not refused_connection(exc)


def when_reachable(paths: Paths, attempt: Callable[[], object], *, verbose: bool, service_gids: list[int],
                   notifier: Notifier, listener: CliListener) -> bool:
    """``attempt()``, again and again while it fails because the database server cannot be reached
    (serving ``status`` on ``listener`` meanwhile); True once it succeeded, False if the backend was
    told to stop while waiting. Other errors propagate."""
    watch = ReachWatch()
    try:
        attempt()
        return True
    except Exception as exc:
        if not _an_outage(exc):
            raise
        setup_daemon_logging("backend", verbose=verbose)
        watch.failed(exc)

    async def until_reached() -> None:
        tries = 1
        while True:
            await asyncio.sleep(next_delay(tries))
            tries += 1
            try:
                await asyncio.to_thread(attempt)
            except Exception as exc:
                if not _an_outage(exc):
                    raise
                watch.probe_failed(exc)
                continue
            watch.succeeded()
            return

    def status() -> dict[str, Any]:
        return {
            "backend": backend_status(paths, BackendState.STORE_UNREACHABLE.value),
            "store": {"path": None, "bytes": None, "free_bytes": None, "out_of_space": None, **watch.status()},
        }

    def refusal() -> IpcError:
        detail = watch.state.detail if watch.state is not None else "unknown"
        return IpcError(STORE_UNREACHABLE, f"the backend waits for the database server ({WHERE}) to open its store:"
                        f" {detail}; start it or check database.url, then retry", True)

    stopped = event_loop.run(serve_while(paths, service_gids, notifier, listener, status=status, refusal=refusal,
                                         why=f"database server ({WHERE}) unreachable; waiting for it",
                                         until=until_reached))
    return not stopped  # not stopped: the wait ended because an attempt succeeded
