"""The skeleton both daemons (``kandev-backend``, ``kandev-agentctl``) share.

Each main does the same things in the same order with these pieces:

1. ``prepare_process()`` first: fds 0-2 open (on ``/dev/null`` if they were closed, so no socket or
   file lands on them), umask 077, the open-file limit raised, SIGHUP and SIGPIPE ignored (a
   hang-up before the event loop runs never kills a starting daemon), and, for a daemon run as
   root outside its unit, ``oom_score_adj`` ``DAEMON_OOM_SCORE_ADJ`` like the units' ``OOMScoreAdjust=``
   (unprivileged, a daemon keeps what it was given: lowering it needs a privilege).
2. ``setup_daemon_logging()``: journald (or stderr), plus a bounded file for the control server;
   a log file that cannot be opened falls back to the journal and says so.
3. In the event loop: ``install_signal_handlers()``: SIGTERM and SIGINT ask to stop, SIGUSR1 logs
   every task (``daemon.core.task_dump``), SIGHUP runs the daemon's hang-up action (the control server
   reloads; the backend has none and ignores it).
4. ``Notifier``: the sd_notify messages (READY, STATUS, STOPPING, RELOADING, EXTEND_TIMEOUT,
   WATCHDOG); each call is one datagram; a no-op outside systemd.
5. ``watched()``: WATCHDOG=1 from the event loop itself while the daemon runs, when the unit
   asks for it (``WatchdogSec=``): a wedged loop stops the pings and systemd restarts the daemon.
6. Exit with an ``ExitCode``: the units and the tests rely on these values; ``exiting()`` around
   main makes the interpreter's teardown skip its final garbage collection.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from enum import IntEnum
from pathlib import Path

import sdnotify

from daemon.core import task_dump
from daemon.core.journal import setup_logging
from daemon.core.limits import raise_open_file_limit

log = logging.getLogger("kandev.service")


class ExitCode(IntEnum):
    """How a daemon's process ends (``kandev-agentctl --reload`` has its own codes)."""

    OK = 0  # a clean stop
    FAILED = 1  # could not serve: another daemon holds the lock, the store or the socket is unusable,
    #             recovery failed, a re-executed image cannot resume
    REFUSED = 2  # refused to start: invalid configuration, launch file or credential (nothing was bound)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def exiting() -> Iterator[None]:
    """Around a daemon's main: once it returns (store closed, sockets closed, logs flushed), the
    objects it made are frozen out of the garbage collector, so the interpreter's teardown does not
    walk them all once more before the kernel frees the memory anyway (~0.15 s for the backend's
    SQLAlchemy and pydantic class graphs: most of an idle ``kandev down``). Teardown itself (exit
    handlers, thread joins, buffered writes) runs as before."""
    try:
        yield
    finally:
        gc.freeze()


def ensure_std_fds() -> None:
    """Make sure fds 0-2 are open (on /dev/null if need be) so no file lands on them."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


DAEMON_OOM_SCORE_ADJ = -100
"""The daemons' ``oom_score_adj`` (the units' ``OOMScoreAdjust=``): agents get +500 at spawn."""


def lower_oom_score() -> None:
    """As root (development, the tests), take the daemons' ``oom_score_adj`` down to the units'
    value; never raise it, and unprivileged do nothing (lowering needs CAP_SYS_RESOURCE)."""
    if os.geteuid() != 0:
        return
    try:
        with open("/proc/self/oom_score_adj", "r+", encoding="ascii") as fh:
            if int(fh.read().strip() or 0) > DAEMON_OOM_SCORE_ADJ:
                fh.seek(0)
                fh.write(str(DAEMON_OOM_SCORE_ADJ))
    except (OSError, ValueError):
        pass


def prepare_process() -> None:
    """The first step of a daemon's start, before it reads anything."""
    ensure_std_fds()
    os.umask(0o077)  # everything a daemon creates is private unless it sets a mode explicitly
    lower_oom_score()
    raise_open_file_limit()  # one stream per session, three pipes per agent
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the loop installs the daemon's own action
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a dead peer is an EPIPE error, never a death


def say(program: str, message: str) -> None:
    """One line on stderr, ``program: message``; never raises (stderr may be closed or a dead pipe)."""
    try:
        print(f"{program}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def setup_daemon_logging(
    component: str,
    *,
    verbose: bool,
    log_file: Path | None = None,
    file_max_bytes: int = 0,
    file_backups: int = 0,
    file_max_age_days: float = 0,
) -> None:
    """Journald (or stderr), plus the bounded ``log_file`` when given; if that file cannot be
    opened, the journal alone, and the reason logged."""
    if log_file is None:
        setup_logging(component, verbose=verbose)
        return
    try:
        setup_logging(component, verbose=verbose, log_file=log_file, file_max_bytes=file_max_bytes,
                      file_backups=file_backups, file_max_age_days=file_max_age_days)
    except OSError as exc:
        setup_logging(component, verbose=verbose)
        logging.getLogger(f"kandev.{component}").error(
            "cannot open the log file %s: %s; logging to the journal/stderr only", log_file, exc
        )


def install_signal_handlers(
    loop: asyncio.AbstractEventLoop, *, stop: Callable[[], None], hangup: Callable[[], None] | None = None
) -> None:
    """SIGTERM/SIGINT -> ``stop``; SIGUSR1 -> a task dump; SIGHUP -> ``hangup``, or nothing.

    SIGHUP gets a handler even when the daemon does nothing with it, rather than staying ignored:
    an ignored signal stays ignored in every child the daemon starts, a handled one does not.
    """
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGUSR1, task_dump.log_tasks)
    loop.add_signal_handler(signal.SIGHUP, hangup if hangup is not None else _ignore)


def _ignore() -> None:
    return None


class Notifier:
    """sd_notify for a ``Type=notify`` unit; every method is a no-op without ``$NOTIFY_SOCKET``.

    One call sends one datagram, so fields that belong together (``READY=1`` and the first
    ``STATUS=``) reach systemd together.
    """

    def __init__(self) -> None:
        self._sd: sdnotify.SystemdNotifier | None = (
            sdnotify.SystemdNotifier() if os.environ.get("NOTIFY_SOCKET") else None
        )
        self._last_status: str | None = None

    def notify(self, *fields: str) -> None:
        """Send ``fields`` (``NAME=value`` each) as one message."""
        if self._sd is not None and fields:
            self._sd.notify("\n".join(fields))

    def ready(self, status: str | None = None) -> None:
        self.notify("READY=1", *self._status_fields(status))

    def status(self, text: str) -> None:
        """``STATUS=text``, sent only when it differs from the last status sent."""
        self.notify(*self._status_fields(text))

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    def reloading(self) -> None:
        """``RELOADING=1`` with the ``MONOTONIC_USEC`` systemd >= 253 requires beside it."""
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def extend_timeout(self, seconds: float) -> None:
        """Keep systemd's start (or stop) timeout ``seconds`` ahead from now."""
        self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def _status_fields(self, text: str | None) -> tuple[str, ...]:
        if text is None or text == self._last_status:
            return ()
        self._last_status = text
        return (f"STATUS={text}",)


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


async def _ping(notifier: Notifier, interval: float) -> None:
    """Ping from the event loop itself: a wedged loop stops the pings and systemd restarts us."""
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def watched(notifier: Notifier) -> AsyncIterator[None]:
    """The watchdog pings for as long as the block runs (startup recovery included), when the unit
    asks for them."""
    interval = watchdog_interval()
    pinger = asyncio.create_task(_ping(notifier, interval), name="watchdog") if interval else None
    try:
        yield
    finally:
        if pinger is not None:
            pinger.cancel()
