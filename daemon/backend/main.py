"""``kandev-backend``: the startup order of docs/architecture.md#backend-startup, then serve until told to stop.

home lock → config validation → store lock (whatever home names the store; a cluster host's
name, Issue 47; a database server that does not answer yet is waited for, serving ``status``,
``daemon.backend.lifetime.reach_wait``) → the store's installation (another one's is refused) → logging → platform check → store (migrations; a store
without an owner is adopted; on a full disk both waits for space, serving ``status``,
``daemon.backend.lifetime.space_wait``) → CLI socket (guards make early requests safe) →
recovery and reconciliation → READY=1. Shutdown detaches from the control server when survival is enabled
(its agents keep running) and stops it when it is our child.

Process set-up, signals (SIGTERM/SIGINT stop, SIGUSR1 task dump, SIGHUP ignored), sd_notify, the
watchdog and the exit codes (0 stopped, 1 could not serve, 2 invalid configuration) are the daemon
skeleton both daemons share (``daemon.core.service``).
"""

from __future__ import annotations

import argparse
import asyncio
import grp
import logging
import os
from typing import Any

from daemon.agentctl.sandbox import memory_cgroups
from daemon.api import ops as api
from daemon.backend.app import Backend
from daemon.backend.cluster.membership import HostForeign
from daemon.backend.lifetime.cli_listener import CliListener
from daemon.backend.lifetime.lock import HomeLock, LockHeld, StoreLock, StoreLocked
from daemon.backend.lifetime.reach_wait import when_reachable
from daemon.backend.lifetime.space_wait import when_space
from daemon.backend.lifetime.store_care import probe_write
from daemon.config.database import connect_args
from daemon.config.keys import ConfigError
from daemon.config.platform import check_capability
from daemon.config.settings import Config, check_config
from daemon.core.heap import freeze_before_recovery, freeze_startup_heap
from daemon.core.journal import log_event
from daemon.core.limits import BUFFER_LIMIT, IDLE_CONNECTION_TIMEOUT_S, connection_limit
from daemon.core.service import (
    ExitCode,
    Notifier,
    exiting,
    install_signal_handlers,
    prepare_process,
    say,
    setup_daemon_logging,
    watched,
)
from daemon.core.version import VERSION
from daemon.host.paths import Paths, installation_id, resolve_home
from daemon.store.db import Store, sqlite_url
from daemon.store.owner import (
    ClusterStoreMismatch,
    ForeignStore,
    check_store_owner,
    claim_store,
    describe_store,
)
from ipc import loop as event_loop
from ipc.server import IpcServer

log = logging.getLogger("kandev.backend")
PROGRAM = "kandev-backend"
SERVICE_GROUP = "kandev"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kandev-backend", description="kandev backend daemon")
    p.add_argument("--home", help="Kandev home (default: $KANDEV_HOME, $STATE_DIRECTORY, ~/.local/share/kandev)")
    p.add_argument("--config", help="config file (default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
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


async def _run(paths: Paths, backend: Backend, notifier: Notifier, listener: CliListener) -> int:
    async with watched(notifier):
        return await _serve_until_stopped(paths, backend, notifier, listener)


async def _serve_until_stopped(paths: Paths, backend: Backend, notifier: Notifier, listener: CliListener) -> int:
    install_signal_handlers(asyncio.get_running_loop(), stop=backend.shutdown_requested.set)

    server = IpcServer(
        paths.backend_socket,
        api.TABLE,
        backend.handlers(),
        allowed_gids=_service_gids(),
        socket_mode=0o660,
        max_connections=connection_limit(),
        idle_timeout=IDLE_CONNECTION_TIMEOUT_S,
        buffer_limit=BUFFER_LIMIT,
        accept_json=True,  # the kandev CLI speaks JSON (ipc.codec_json)
    )
    await listener.serve(server)
    notifier.status("recovering")
    # Recovery may take up to the deadline (max 5 min): keep systemd's start timeout ahead of it.
    notifier.extend_timeout(backend.config.agentctl.recovery_deadline + 60)
    log.debug("heap frozen before recovery: %d objects", freeze_before_recovery())
    try:
        await backend.recover()
    except Exception as exc:
        log.exception("startup recovery failed")
        log_event("backend_start_failed", f"startup failed: {exc}", priority=3, REASON=type(exc).__name__)
        await server.close()
        await backend.shutdown()
        return ExitCode.FAILED
    status = _status_line(backend)
    notifier.ready(status)
    log_event(
        "backend_ready",
        f"backend ready: {status}",
        CAPABILITY=backend.capability.state,
        ADOPTION=backend.report.adoption.outcome,
        RETRACKED=len(backend.report.retracked),
        RECOVERY_MS=round(backend.report.duration_ms),
    )
    log.debug("start-up heap frozen: %d objects", freeze_startup_heap())
    await backend.shutdown_requested.wait()
    notifier.stopping()
    await server.close()
    await backend.shutdown()
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    with exiting():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    prepare_process()  # everything under the home is private; the run dir and CLI socket set their modes
    paths = Paths.for_home(resolve_home(args.home))
    paths.ensure()
    lock = HomeLock(paths.lock_path)
    listener = CliListener()  # the CLI socket, handed from the server waiting for space to the next
    try:
        lock.acquire()  # before anything else: a second backend stops here
    except LockHeld as exc:
        say(PROGRAM, str(exc))
        return ExitCode.FAILED
    try:
        try:
            # The control server validates its own keys again at its start; checking them
            # here too means a bad value stops the backend before it launches anything.
            config = check_config(args.config, os.environ)
            connect = connect_args(config)  # the database password (database.password_file), never logged
        except ConfigError as exc:
            say(PROGRAM, f"invalid configuration: {exc}")
            return ExitCode.REFUSED
        # cgroup v2, our unit delegated: room for the agents' memory cgroups of a control server that
        # is our child (survival off, passthrough); where there is none, that server says why
        memory_cgroups.make_room()
        url = config.database.url or sqlite_url(paths.db_path)
        host = config.cluster.host  # a cluster's host (Issue 47): the store is shared, the host name is not
        store_lock = StoreLock(url, host, connect)
        notifier = Notifier()
        try:
            # one backend per store too, whatever home names it; before logging. A database server
            # that does not answer yet is waited for (daemon.backend.lifetime.reach_wait).
            if not when_reachable(paths, store_lock.acquire, verbose=args.verbose, service_gids=_service_gids(),
                                  notifier=notifier, listener=listener):
                return ExitCode.OK  # told to stop while waiting for the database server
        except StoreLocked as exc:
            say(PROGRAM, str(exc))
            return ExitCode.FAILED
        except Exception as exc:
            say(PROGRAM, f"cannot lock the store: {type(exc).__name__}: {exc}")
            return ExitCode.FAILED
        ours = installation_id(paths)
        try:
            # A store of another installation is refused before anything reads or migrates it.
            # On a full disk: reported and waited out, not a crash loop (daemon.backend.lifetime.space_wait).
            def owner_checked() -> bool:
                check_store_owner(url, ours, describe_store(url), cluster_host=host, connect_args=connect)
                return True

            if when_space(paths, url, owner_checked, verbose=args.verbose, service_gids=_service_gids(),
                          notifier=notifier, listener=listener) is None:
                return ExitCode.OK  # told to stop while waiting for space
        except (ForeignStore, ClusterStoreMismatch) as exc:
            say(PROGRAM, str(exc))
            return ExitCode.FAILED
        except Exception as exc:
            say(PROGRAM, f"cannot read the store: {type(exc).__name__}: {exc}")
            return ExitCode.FAILED
        try:
            return _serve(args, paths, config, url, connect, notifier, listener, store_lock)
        finally:
            store_lock.release()
    finally:
        listener.release()  # a listener is held only if we stop before serving it again
        lock.release()


def _serve(args: argparse.Namespace, paths: Paths, config: Config, url: str, connect: dict[str, Any],
           notifier: Notifier, listener: CliListener, store_lock: StoreLock) -> int:
    """Logging → platform check → store (migrations) → the event loop, with both locks held."""
    setup_daemon_logging("backend", verbose=args.verbose)
    capability = check_capability(config)
    log_event(
        "capability",
        f"agent survival capability: {capability.state}"
        + (f" ({capability.reason}: {capability.detail})" if capability.reason else ""),
        STATE=capability.state,
        REASON=capability.reason,
        SUPERVISOR=capability.supervisor,
    )
    store = when_space(paths, url, lambda: Store.open(url, connect_args=connect), verbose=args.verbose,
                       service_gids=_service_gids(), notifier=notifier, listener=listener)
    if store is None:
        return ExitCode.OK  # told to stop while waiting for space
    ours = installation_id(paths)
    try:
        if config.cluster.host is None and claim_store(store.engine, ours, describe_store(url)):
            log_event("store_adopted", f"the store now belongs to installation {ours}", INSTALLATION_ID=ours)
    except ForeignStore as exc:
        store.close()
        say(PROGRAM, str(exc))
        return ExitCode.FAILED
    # A store that opens but takes no write (a full disk): waited out before recovery, which writes.
    if when_space(paths, url, lambda: probe_write(store, need_room=True), verbose=args.verbose,
                  service_gids=_service_gids(), notifier=notifier, listener=listener) is None:
        store.close()
        return ExitCode.OK
    backend = Backend(paths, config, capability, store, ours)
    # a PostgreSQL server that restarts or ends the lock's connection drops the lock: taken again
    backend.context.store_care.keep_lock = store_lock.ensure
    try:
        backend.cluster.directory.claim()  # a cluster host's name: ours (its advisory lock is held)
    except HostForeign as exc:
        store.close()
        say(PROGRAM, str(exc))
        return ExitCode.FAILED
    if backend.cluster.identity.enabled:
        log_event("cluster_host_claimed", f"cluster host {config.cluster.host} claimed by pid {os.getpid()}",
                  HOST=config.cluster.host)
    try:
        return event_loop.run(_run(paths, backend, notifier, listener))
    finally:
        store.close()


if __name__ == "__main__":
    raise SystemExit(main())
