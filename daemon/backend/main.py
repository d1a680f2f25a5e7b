"""``kandev-backend``: the startup order of docs/architecture.md#backend-startup, then serve until told to stop.

home lock → config validation → store lock (whatever home names the store) → the store's
installation (another one's is refused) → logging → platform check → store (migrations; a store
without an owner is adopted) → CLI socket (guards make early requests safe) →
recovery and reconciliation → READY=1. Shutdown detaches from the control server when survival is enabled
(its agents keep running) and stops it when it is our child.
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Mapping

import sdnotify

from daemon import task_dump
from daemon.backend import api
from daemon.backend.app import Backend
from daemon.backend.lock import HomeLock, LockHeld, StoreLock, StoreLocked
from daemon.config import Config, ConfigError, load_config, validate_agentctl, validate_backend
from daemon.journal import log_event, setup_logging
from daemon.limits import BUFFER_LIMIT, IDLE_CONNECTION_TIMEOUT_S, connection_limit, raise_open_file_limit
from daemon.paths import Paths, installation_id, resolve_home
from daemon.platform import check_capability
from daemon.store.db import Store, sqlite_url
from daemon.store.owner import ForeignStore, check_store_owner, claim_store, describe_store
from ipc.server import IpcServer

log = logging.getLogger("kandev.backend")
SERVICE_GROUP = "kandev"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kandev-backend", description="kandev backend daemon")
    p.add_argument("--home", help="Kandev home (default: $KANDEV_HOME, $STATE_DIRECTORY, ~/.local/share/kandev)")
    p.add_argument("--config", help="config file (default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _service_gids() -> list[int]:
    try:
        return [grp.getgrnam(SERVICE_GROUP).gr_gid]
    except KeyError:
        return []


def _status_line(backend: Backend) -> str:
    r = backend.report
    return (
        f"capability={backend.capability.state}"
        + (f"({backend.capability.reason})" if backend.capability.reason else "")
        + f" adoption={r.adoption.outcome}"
        + (f"({r.adoption.reason})" if r.adoption.reason else "")
        + f" retracked={len(r.retracked)} not_retracked={len(r.not_retracked)}"
    )


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC (WatchdogSec= of the unit), or None
    when systemd expects none (unset, unparsable, or $WATCHDOG_PID naming another process)."""
    environ = os.environ if env is None else env
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    return usec / 2 / 1_000_000 if usec > 0 else None


async def _watchdog(notifier: sdnotify.SystemdNotifier, interval: float) -> None:
    """Ping from the event loop itself: a wedged loop stops the pings and systemd restarts us."""
    while True:
        notifier.notify("WATCHDOG=1")
        await asyncio.sleep(interval)


async def _watched(run: Awaitable[int], notifier: sdnotify.SystemdNotifier) -> int:
    """``run`` with the watchdog pinging beside it (recovery included) when the unit asks for it."""
    interval = watchdog_interval()
    watchdog = asyncio.create_task(_watchdog(notifier, interval)) if interval else None
    try:
        return await run
    finally:
        if watchdog is not None:
            watchdog.cancel()


async def _run(paths: Paths, backend: Backend, notifier: sdnotify.SystemdNotifier) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, backend.shutdown_requested.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    loop.add_signal_handler(signal.SIGUSR1, task_dump.log_tasks)

    server = IpcServer(
        paths.backend_socket,
        api.TABLE,
        backend.handlers(),
        allowed_gids=_service_gids(),
        socket_mode=0o660,
        max_connections=connection_limit(),
        idle_timeout=IDLE_CONNECTION_TIMEOUT_S,
        buffer_limit=BUFFER_LIMIT,
    )
    await server.start()
    notifier.notify("STATUS=recovering")
    # Recovery may take up to the deadline (max 5 min): keep systemd's start timeout ahead of it.
    extend_us = int((backend.config.agentctl.recovery_deadline + 60) * 1_000_000)
    notifier.notify(f"EXTEND_TIMEOUT_USEC={extend_us}")
    try:
        await backend.recover()
    except Exception as exc:
        log.exception("startup recovery failed")
        log_event("backend_start_failed", f"startup failed: {exc}", priority=3, REASON=type(exc).__name__)
        await server.close()
        await backend.shutdown()
        return 1
    status = _status_line(backend)
    notifier.notify("READY=1")
    notifier.notify(f"STATUS={status}")
    log_event(
        "backend_ready",
        f"backend ready: {status}",
        CAPABILITY=backend.capability.state,
        ADOPTION=backend.report.adoption.outcome,
        RETRACKED=len(backend.report.retracked),
        RECOVERY_MS=round(backend.report.duration_ms),
    )
    await backend.shutdown_requested.wait()
    notifier.notify("STOPPING=1")
    await server.close()
    await backend.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.umask(0o077)  # everything under the home is private; the run dir and CLI socket are set explicitly
    raise_open_file_limit()  # one event stream per tracked session
    paths = Paths.for_home(resolve_home(args.home))
    paths.ensure()
    lock = HomeLock(paths.lock_path)
    try:
        lock.acquire()  # before anything else: a second backend stops here
    except LockHeld as exc:
        print(f"kandev-backend: {exc}", file=sys.stderr)
        return 1
    try:
        try:
            config = load_config(args.config, os.environ)
            validate_backend(config)
            # The control server validates its own keys again at its start; checking them
            # here too means a bad value stops the backend before it launches anything.
            agentctl = config.agentctl
            validate_agentctl(
                agentctl.detached_event_limit, agentctl.unowned_period, agentctl.idle_timeout,
                origins=config.origins,
            )
        except ConfigError as exc:
            print(f"kandev-backend: invalid configuration: {exc}", file=sys.stderr)
            return 2
        url = config.database.url or sqlite_url(paths.db_path)
        store_lock = StoreLock(url)
        try:
            store_lock.acquire()  # one backend per store too, whatever home names it; before logging
        except StoreLocked as exc:
            print(f"kandev-backend: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:  # e.g. the database server is down
            print(f"kandev-backend: cannot lock the store: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        ours = installation_id(paths)
        try:
            # A store of another installation is refused before anything reads or migrates it.
            check_store_owner(url, ours, describe_store(url))
        except ForeignStore as exc:
            print(f"kandev-backend: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:
            print(f"kandev-backend: cannot read the store: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        try:
            return _serve(args, paths, config, url)
        finally:
            store_lock.release()
    finally:
        lock.release()


def _serve(args: argparse.Namespace, paths: Paths, config: Config, url: str) -> int:
    """Logging → platform check → store (migrations) → the event loop, with both locks held."""
    setup_logging("backend", verbose=args.verbose)
    capability = check_capability(config)
    log_event(
        "capability",
        f"agent survival capability: {capability.state}"
        + (f" ({capability.reason}: {capability.detail})" if capability.reason else ""),
        STATE=capability.state,
        REASON=capability.reason,
        SUPERVISOR=capability.supervisor,
    )
    store = Store.open(url)
    ours = installation_id(paths)
    try:
        if claim_store(store.engine, ours, describe_store(url)):
            log_event("store_adopted", f"the store now belongs to installation {ours}", INSTALLATION_ID=ours)
    except ForeignStore as exc:
        store.close()
        print(f"kandev-backend: {exc}", file=sys.stderr)
        return 1
    backend = Backend(paths, config, capability, store, ours)
    notifier = sdnotify.SystemdNotifier()
    try:
        return asyncio.run(_watched(_run(paths, backend, notifier), notifier))
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
