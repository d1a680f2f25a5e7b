"""``kandev-agentctl``: the control server's entry point.

Order: load the launch file (``--launch-file``, else ``<home>/agentctl/
launch.json`` with the home from ``--home``, ``$KANDEV_HOME`` or
``$STATE_DIRECTORY``) -> logging (journald when present, plus the server's
own bounded file, AC-EXECUTORS-SURVIVAL-001.3) -> validate the settings
(exit 2 with the reason, before anything is bound; AC-EXECUTORS-SURVIVAL-001.8)
-> read the credential -> import everything it will ever run (``preload``) ->
bind the socket -> ``READY=1``.

SIGTERM/SIGINT stop every instance (their process groups are killed), close
the socket and exit 0; so do ``ownership_shutdown`` and the unowned shutdown
(no claim, rotation or bootstrap for the resolved unowned period: the server's
own timer latches, stops every instance and exits 0;
AC-EXECUTORS-CONTROL-OWNERSHIP-003.1). SIGHUP reloads: the server re-executes
the installed code in place with its state handed over, every agent keeps
running (``daemon.agentctl.reload.reexec``); before the handler is installed it is
ignored, so a detached server never dies of a hang-up. stdin, stdout and
stderr may be ``/dev/null`` or gone; a failed log write is never fatal.

Other modes of the same entry point: ``--reload`` asks the running server to
reload and waits for the outcome (``daemon.agentctl.reload.client``, the unit's
``ExecReload=``); ``--resume-state-fd N`` is the new image of a reload
(``daemon.agentctl.reload.resume``); ``--preflight`` is a reload's preflight
(``daemon.agentctl.reload.preflight``). Agents are spawned by the event loop in the
main thread and children are watched through pidfds (no watcher thread): the
thread that spawned them is the one that execs, so their parent-death signal
never fires on a reload. For that reason it runs on asyncio's own event loop, not on uvloop
(``ipc.loop``, the backend's): uvloop spawns and reaps children its own way (libuv's SIGCHLD
handler), ignoring the pidfd child watcher the reload depends on.

Exit codes (``daemon.core.service.ExitCode``): 0 clean stop, 1 could not serve (e.g. the socket is in
use), 2 refused to start (bad launch file, settings or credential). The process set-up, signals,
sd_notify and logging are the daemon skeleton both daemons share (``daemon.core.service``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

import daemon.agentctl.acp_lean  # noqa: F401  (before the SDK: its models built lean, see the module)
from daemon.agentctl import launch
from daemon.agentctl.handover import HandoverError
from daemon.agentctl.launch import LaunchConfig, LaunchError
from daemon.agentctl.reload import client as reload_client
from daemon.agentctl.reload import preflight, preload, resume
from daemon.agentctl.reload.reexec import Reloader
from daemon.config.agentctl import ResolvedAgentctl
from daemon.config.keys import ConfigError
from daemon.core import faults
from daemon.core.heap import freeze_startup_heap
from daemon.core.journal import log_event
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
from daemon.host.paths import resolve_home
from ipc.errors import IpcError

log = logging.getLogger("kandev.agentctl")

# AC-EXECUTORS-SURVIVAL-001.3: fixed bounds of the server's own log file, never settings.
LOG_FILE_MAX_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 5
LOG_FILE_MAX_AGE_DAYS = 14

PROGRAM = "kandev-agentctl"
# Blocked by the previous image across a re-exec (daemon.agentctl.reload.reexec); unblocked once handled.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kandev-agentctl", description="Kandev control server: supervises ACP agent processes."
    )
    parser.add_argument("--home", help="Kandev home (default: $KANDEV_HOME, $STATE_DIRECTORY)")
    parser.add_argument("--launch-file", help="launch file (default: <home>/agentctl/launch.json)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")
    parser.add_argument("--reload", action="store_true",
                        help="ask the running control server to re-execute the installed code in place (its"
                        " agents keep running) and wait for the outcome; exit 0 done, 1 refused, 3 the server"
                        " predates reload")
    parser.add_argument("--pid", type=int, help="with --reload: the pid the server must have ($MAINPID)")
    parser.add_argument("--resume-state-fd", type=int, help=argparse.SUPPRESS)  # a reload's new image
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)  # a reload's preflight
    return parser.parse_args(argv)


def _refuse(message: str, *, logged: bool = True) -> int:
    """Say why the server will not start (stderr, and the log once it is set up); exit code 2."""
    say(PROGRAM, message)
    if logged:
        try:
            log_event("agentctl_refused", message, priority=3)
        except Exception:
            pass
    return ExitCode.REFUSED


def _setup_logging(config: LaunchConfig, verbose: bool) -> None:
    setup_daemon_logging(
        "agentctl",
        verbose=verbose,
        log_file=Path(config.log_path),
        file_max_bytes=LOG_FILE_MAX_BYTES,
        file_backups=LOG_FILE_BACKUPS,
        file_max_age_days=LOG_FILE_MAX_AGE_DAYS,
    )


def _ensure_socket_dir(socket_path: str) -> None:
    """Create the socket's directory 0700 if missing; an existing one is left as it is."""
    os.makedirs(os.path.dirname(os.path.abspath(socket_path)), mode=0o700, exist_ok=True)


def _use_pidfd_child_watcher() -> None:
    """Watch children through pidfds from the event loop: no waitpid thread, so reaping happens
    only in the loop (a re-exec never loses an exit status to a thread) and nothing but the main
    thread ever forks an agent."""
    watcher = asyncio.PidfdChildWatcher()
    asyncio.set_child_watcher(watcher)
    watcher.attach_loop(asyncio.get_running_loop())


def _request_reload(reloader: Reloader) -> None:
    try:
        reloader.request("SIGHUP")
    except IpcError as exc:
        log.warning("reload signal ignored: %s", exc.message)


def _serving(count: int) -> str:
    """The control server's sd_notify status line."""
    return f"serving {count} instance{'' if count == 1 else 's'}"


async def _serve(
    config: LaunchConfig,
    resolved: ResolvedAgentctl,
    credential: bytes | None,
    *,
    resumed: resume.Resumed | None = None,
    reexec_args: tuple[str, ...] = (),
) -> int:
    _use_pidfd_child_watcher()
    notifier = Notifier()
    async with watched(notifier):
        return await _serve_until_stopped(config, resolved, credential, notifier, resumed, reexec_args)


async def _serve_until_stopped(
    config: LaunchConfig,
    resolved: ResolvedAgentctl,
    credential: bytes | None,
    notifier: Notifier,
    resumed: resume.Resumed | None,
    reexec_args: tuple[str, ...],
) -> int:
    # Imported here, not at the top: ``--reload`` (the unit's ExecReload=, new code too) must run
    # even when a module only the server needs is broken; the preflight then refuses that version.
    # preload.import_everything() has imported it already, before anything serves.
    from daemon.agentctl.server import AgentctlServer

    def on_instances_changed(count: int) -> None:
        notifier.status(_serving(count))

    if resumed is None:
        assert credential is not None
        server = AgentctlServer(config, resolved, credential, on_instances_changed=on_instances_changed)
        del credential
        try:
            _ensure_socket_dir(config.socket_path)
            await server.start()
        except (OSError, ValueError) as exc:
            say(PROGRAM, f"cannot listen on {config.socket_path}: {exc}")
            log_event("agentctl_failed", f"cannot listen on {config.socket_path}: {exc}", priority=3,
                      SOCKET=config.socket_path)
            return ExitCode.FAILED
    else:
        try:
            server = AgentctlServer.from_handover(resumed.state, config, resolved,
                                                  on_instances_changed=on_instances_changed)
            await server.start_handed_over(resumed.state, resume.listener(resumed.state))
        except Exception as exc:  # the preflight ran this very code on this very state: a bug
            log.exception("cannot resume from the handed-over state")
            log_event("agentctl_failed", f"the re-executed control server cannot resume: {exc}", priority=2)
            resume.close_inherited(resumed.state)
            return ExitCode.FAILED
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    reloader = Reloader(server, notify=notifier.notify, stop_requested=stop.is_set, extra_args=reexec_args)
    server.reloader = reloader
    install_signal_handlers(loop, stop=stop.set, hangup=lambda: _request_reload(reloader))
    # A stop signal that arrived while the previous image was exec'ing waited, blocked, until now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    if resumed is not None:
        resume.reexecuted(server, resumed)
        notifier.ready(_serving(len(server.instances)))
    else:
        notifier.ready(_serving(0))
        log_event(
            "agentctl_started",
            f"control server {server.server_identity} serving on {config.socket_path} (mode {config.mode},"
            f" detached_event_limit {server.detached_event_limit}, unowned period {server.unowned_period_s:g} s)",
            SOCKET=config.socket_path,
            MODE=config.mode,
            SERVER_IDENTITY=server.server_identity,
            PID=os.getpid(),
        )
    log.debug("start-up heap frozen: %d objects", freeze_startup_heap())
    # From here on every import is reported: what the server runs was imported before ready.
    preload.LateImportWatch(loop, preload.report_late_import(log_event, log)).install()
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.exit_requested.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    await reloader.idle.wait()  # a reload under way ends first (it sees the stop and is refused)
    reason = "signal" if stop.is_set() else (server.exit_reason or "ownership_shutdown")
    notifier.stopping()
    stopped = await server.shutdown()
    log_event(
        "agentctl_stopped",
        f"control server {server.server_identity} stopped ({reason}); stopped {len(stopped)} instance(s)",
        REASON=reason,
        SERVER_IDENTITY=server.server_identity,
    )
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    with exiting():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = _parse_args(argv)
    if args.preflight:
        return preflight.run()
    prepare_process()
    logging.raiseExceptions = False  # a log write must never kill the server (AC-EXECUTORS-SURVIVAL-001.3)

    if args.launch_file:
        launch_path = Path(args.launch_file)
    else:
        launch_path = launch.default_launch_file(resolve_home(args.home))
    if args.reload:
        return reload_client.run(launch_path, pid=args.pid)
    # No mixed code: everything this server will run is imported now, before it serves.
    preload.import_everything()
    # The next image gets the same options (--launch-file/--home are not needed, but show in ps).
    reexec_args = tuple(a for a in (
        *(("--verbose",) if args.verbose else ()),
        *(("--launch-file", args.launch_file) if args.launch_file else ()),
        *(("--home", args.home) if args.home else ()),
    ))
    if args.resume_state_fd is not None:
        return _resume(args.resume_state_fd, args.verbose, reexec_args)
    try:
        config = launch.load(launch_path)
    except LaunchError as exc:
        return _refuse(f"refusing to start: {exc}", logged=False)
    _setup_logging(config, args.verbose)
    faults.hit("agentctl_dies_at_start")  # test fault, off unless $KANDEV_FAULT(_FILE) says so
    try:
        resolved = launch.validate(config)
    except ConfigError as exc:
        return _refuse(f"refusing to start: {exc}")
    for note in resolved.notes:  # every note is an unowned-period adjustment (AC-EXECUTORS-CONTROL-OWNERSHIP-003.4, AC-EXECUTORS-CONTROL-OWNERSHIP-003.6, AC-EXECUTORS-CONTROL-OWNERSHIP-003.7)
        log_event("unowned_period_adjusted", note, priority=5, UNOWNED_PERIOD_S=f"{resolved.unowned_period:g}")
    try:
        credential = launch.read_credential(config)
    except LaunchError as exc:
        return _refuse(f"refusing to start: {exc}")
    try:
        return asyncio.run(_serve(config, resolved, credential, reexec_args=reexec_args))
    except KeyboardInterrupt:
        return ExitCode.OK


def _resume(state_fd: int, verbose: bool, reexec_args: tuple[str, ...]) -> int:
    """The new image of a reload: same pid, the agents' pipes and the socket inherited."""
    try:
        resumed = resume.load(state_fd)
    except HandoverError as exc:  # the preflight decoded this same state: should never happen
        return _refuse(f"cannot resume from the handed-over state: {exc}", logged=False)
    _setup_logging(resumed.config, verbose)
    try:
        resolved = launch.validate(resumed.config, check_secrets=False)
    except ConfigError as exc:
        resume.close_inherited(resumed.state)
        return _refuse(f"cannot resume: {exc}")
    try:
        return asyncio.run(_serve(resumed.config, resolved, None, resumed=resumed, reexec_args=reexec_args))
    except KeyboardInterrupt:
        return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
