"""The backend's link to one control server: connect, watch, lose, restart with back-off, give up.

A control server can die under a running backend (the OOM killer, a crash, ``kill -9``,
``systemctl kill``); its agents die with it. The link turns that into an event the backend
handles instead of a state it cannot leave. Its life, supervisord-style::

    none ──attach──▶ running ──(process gone)──▶ lost ──▶ restarting ──(started)──▶ running
                        │                                   │  ▲    │
                        │                                   │  └────┘ (start failed: back-off)
                        ▼                                   ▼
                    superseded                           gave_up ──retry()──▶ restarting

    running ──replace()──▶ replacing ──(started)──▶ running      (start failed: as restarting)

- **running**: a ``ServerWatch`` looks at the server every ``watch_interval`` (0.5 s), so a loss
  is seen well within 2 s.
- **lost**: one journal entry ``control_server_lost`` with the reason (exit status or signal when
  known); then ``on_lost`` makes every session that lived on the server truthful (the backend's
  repair, shared with startup recovery) and returns the sessions it interrupted.
- **restarting**: after a back-off a fresh server is started the way startup does (``start``:
  the unit under systemd, detached or child otherwise; a fresh credential and record). A start
  that fails counts as a loss too. Back-off and give-up come from ``CrashLoop``.
- **gave_up**: ``CrashLoop.limit`` losses within ``CrashLoop.window``: nothing more is tried (no
  task runs, the backend idles) until ``retry()`` (``kandev up``) or a backend restart.
- **superseded**: another holder of this installation's credential adopted the server; it is
  not ours any more, so it is neither watched nor restarted (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3).
- **replacing**: the backend itself retires a running server it chose to replace (one too old to
  reload in place, once it runs no instance: ``daemon.backend.lifetime.server_upgrade``); its end is no
  loss, and its successor is started by ``start`` like a restart (a start that fails is then a
  loss at start: back-off, give-up). A re-exec of the server in place (reload) is not even seen
  here: same pid, same start time, so the watch never finds it gone.

Once a new server runs, ``on_restarted`` gets the sessions interrupted since the last one ran
(it schedules the automatic resume, when switched on). Everything that takes time is injected (``sleep``,
the clocks, the watch), so the state machine is unit-tested without processes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from daemon.api.ops import LinkState
from daemon.core.journal import log_event
from ipc.aio import cancel_and_wait

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
BACKOFF_S = (1.0, 2.0, 5.0)
CRASH_LOOP_LIMIT = 5
CRASH_LOOP_WINDOW_S = 300.0





class Watch(Protocol):
    """What the link needs to know about one server (``daemon.backend.control.watch.ServerWatch``)."""

    async def gone(self) -> bool: ...

    async def reason(self) -> str: ...


@dataclass
class Attached:
    """A running server as the link holds it: its handle (``ControlServerHandle``), the backend's
    client of it, and the watch that tells when it is gone."""

    handle: Any
    client: Any
    watch: Watch


@dataclass(frozen=True)
class Loss:
    at: datetime
    reason: str
    at_start: bool  # a start attempt that failed, not a running server that went away

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at.isoformat().replace("+00:00", "Z"), "reason": self.reason, "at_start": self.at_start}


class CrashLoop:
    """Back-off and crash-loop limit, on an injected monotonic clock.

    Every loss (a server that went away, or a start that failed) is recorded. The delay before
    the next start grows with the number of losses in the window (1 s, 2 s, then 5 s each);
    at ``limit`` losses within ``window`` seconds ``record`` answers None: give up.
    """

    def __init__(
        self,
        *,
        backoff: Sequence[float] = BACKOFF_S,
        limit: int = CRASH_LOOP_LIMIT,
        window: float = CRASH_LOOP_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not backoff or limit < 1 or window <= 0:
            raise ValueError("a crash loop needs a back-off, a limit >= 1 and a window > 0")
        self.backoff = tuple(backoff)
        self.limit = limit
        self.window = window
        self.clock = clock
        self.losses: list[float] = []

    def _prune(self) -> None:
        now = self.clock()
        self.losses = [t for t in self.losses if now - t < self.window]

    def record(self) -> float | None:
        """Record a loss now; the delay before the next start, or None to give up."""
        self._prune()
        self.losses.append(self.clock())
        if len(self.losses) >= self.limit:
            return None
        return self.backoff[min(len(self.losses), len(self.backoff)) - 1]

    @property
    def recent(self) -> int:
        """Losses within the window."""
        self._prune()
        return len(self.losses)

    def reset(self) -> None:
        self.losses.clear()


StartFn = Callable[[], Awaitable[Attached]]
RetireFn = Callable[[Attached], Awaitable[None]]  # ends a server the backend replaces
LostFn = Callable[[Attached, Loss], Awaitable[list[str]]]
RestartedFn = Callable[[list[str]], None]  # must not block: e.g. it schedules the automatic resume


@dataclass
class ControlServerLink:
    """One control server's life as this backend sees it (see the module docstring)."""

    name: str  # "survival" (the server sessions use) or "passthrough" (the backend's own child)
    start: StartFn
    on_lost: LostFn
    on_restarted: RestartedFn | None = None
    policy: CrashLoop = field(default_factory=CrashLoop)
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    wall: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    watch_interval: float = WATCH_INTERVAL_S
    state: LinkState = LinkState.NONE
    attached: Attached | None = None
    last_loss: Loss | None = None
    gave_up: Loss | None = None  # the loss after which it gave up
    interrupted: list[str] = field(default_factory=list)  # sessions to resume once a server runs again
    restarts: int = 0
    replacements: int = 0
    _task: asyncio.Task[None] | None = None
    _closed: bool = False

    # ----------------------------------------------------------------- control
    def attach(self, attached: Attached) -> None:
        """Watch a server that runs (started or adopted at startup, or started lazily)."""
        if self._closed:
            return
        self._stop_task()
        self.attached = attached
        self._set(LinkState.RUNNING)
        self._task = asyncio.get_running_loop().create_task(self._supervise(attached), name=f"link-{self.name}")

    def start_failed(self, reason: str) -> None:
        """The very first start (at backend startup) failed: count it as a loss and keep trying as
        after one, so that the backend stays up and says why."""
        if self._closed or self.state != LinkState.NONE:
            return
        self.last_loss = Loss(self.wall(), reason, at_start=True)
        delay = self.policy.record()
        self._set(LinkState.RESTARTING)
        self._task = asyncio.get_running_loop().create_task(self._restart(delay), name=f"link-{self.name}")

    def release(self, state: LinkState = LinkState.SUPERSEDED) -> None:
        """Stop watching without counting a loss (the server is not ours any more)."""
        self._stop_task()
        self._set(state)

    async def replace(self, retire: RetireFn) -> bool:
        """Replace the running server on purpose (see the module docstring): stop watching it
        (its end is no loss), ``retire`` it, then start its successor through ``start``. False,
        with nothing done, unless the link is running. A retirement that fails puts the old server
        back under watch (if it is gone after all, that is a loss); a start that fails is recorded
        as a loss at start and the link goes on trying by itself; both raise to the caller too."""
        if self._closed or self.state != LinkState.RUNNING or self.attached is None:
            return False
        old = self.attached
        self._stop_task()
        self.attached = None
        self._set(LinkState.REPLACING)
        try:
            await retire(old)
        except BaseException:
            # (the state may have changed during the await; mypy keeps its narrowing from above)
            if not self._closed and self.state == LinkState.REPLACING:  # type: ignore[comparison-overlap]
                self.attach(old)
            raise
        try:
            attached = await self.start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = f"start of a replacement failed: {exc}" if str(exc) else \
                f"start of a replacement failed: {type(exc).__name__}"
            self.last_loss = Loss(self.wall(), reason, at_start=True)
            delay = self.policy.record()
            log_event("control_server_restart_failed", f"control server link {self.name}: {reason}",
                      priority=3, LINK=self.name, REASON=reason, LOSSES_IN_WINDOW=self.policy.recent)
            if not self._closed:
                self._set(LinkState.RESTARTING)
                self._task = asyncio.get_running_loop().create_task(self._restart(delay), name=f"link-{self.name}")
            raise
        self.replacements += 1
        self.attach(attached)
        return True

    def retry(self) -> bool:
        """After giving up: forget the crash loop and try again at once. False if not given up."""
        if self._closed or self.state != LinkState.GAVE_UP:
            return False
        self.policy.reset()
        self.gave_up = None
        self._set(LinkState.RESTARTING)
        self._task = asyncio.get_running_loop().create_task(self._restart(0.0), name=f"link-{self.name}")
        return True

    async def close(self) -> None:
        """Backend shutdown: stop watching and restarting (whatever the backend then does to the
        server is not a loss)."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            await cancel_and_wait(task)

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "last_loss": self.last_loss.to_json() if self.last_loss else None,
            "losses_in_window": self.policy.recent,
            "crash_loop": {"limit": self.policy.limit, "window_s": self.policy.window},
            "gave_up": self.gave_up.to_json() if self.gave_up else None,
            "restarts": self.restarts,
            "replacements": self.replacements,
        }

    # ---------------------------------------------------------------- internals
    def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _set(self, state: LinkState) -> None:
        if state != self.state:
            log.info("control server link %s: %s -> %s", self.name, self.state.value, state.value)
            self.state = state

    async def _supervise(self, attached: Attached) -> None:
        while True:
            try:
                if await attached.watch.gone():
                    break
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe that fails is not a loss; look again next time
                log.exception("control server link %s: watching failed", self.name)
            await self.sleep(self.watch_interval)
        try:
            reason = await attached.watch.reason()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the loss stands; only its reason is unknown
            reason = f"its process is gone; the reason could not be read ({type(exc).__name__}: {exc})"
        self._set(LinkState.LOST)
        self.attached = None
        loss = Loss(self.wall(), reason, at_start=False)
        self.last_loss = loss
        delay = self.policy.record()
        handle = attached.handle
        log_event(
            "control_server_lost",
            f"control server ({getattr(handle, 'mode', '?')}) pid {getattr(handle, 'pid', None)} is gone: {reason}",
            priority=3, LINK=self.name, REASON=reason, MODE=getattr(handle, "mode", None),
            SERVER_PID=getattr(handle, "pid", None), ENDPOINT=getattr(handle, "endpoint", None),
            LOSSES_IN_WINDOW=self.policy.recent,
        )
        try:
            interrupted = await self.on_lost(attached, loss)
        except Exception:
            log.exception("control server link %s: making the sessions truthful failed", self.name)
            interrupted = []
        self.interrupted.extend(s for s in interrupted if s not in self.interrupted)
        await self._restart(delay)

    async def _restart(self, delay: float | None) -> None:
        while True:
            if delay is None:
                self._give_up()
                return
            self._set(LinkState.RESTARTING)
            if delay > 0:
                await self.sleep(delay)
            try:
                attached = await self.start()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = f"restart failed: {exc}" if str(exc) else f"restart failed: {type(exc).__name__}"
                self.last_loss = Loss(self.wall(), reason, at_start=True)
                delay = self.policy.record()
                log_event("control_server_restart_failed", f"control server link {self.name}: {reason}",
                          priority=3, LINK=self.name, REASON=reason, LOSSES_IN_WINDOW=self.policy.recent)
                continue
            break
        self.restarts += 1
        handle = attached.handle
        log_event(
            "control_server_restarted",
            f"control server link {self.name}: a new control server ({getattr(handle, 'mode', '?')}) runs, pid"
            f" {getattr(handle, 'pid', None)}; {len(self.interrupted)} interrupted session(s)",
            LINK=self.name, MODE=getattr(handle, "mode", None), SERVER_PID=getattr(handle, "pid", None),
            COUNT=len(self.interrupted),
        )
        interrupted, self.interrupted = self.interrupted, []
        self.attach(attached)  # a new watch task takes over; this one ends here
        if self.on_restarted is not None and interrupted:
            try:
                self.on_restarted(interrupted)
            except Exception:
                log.exception("control server link %s: on_restarted failed", self.name)

    def _give_up(self) -> None:
        loss = self.last_loss
        self.gave_up = loss
        self._set(LinkState.GAVE_UP)
        reason = loss.reason if loss else "unknown"
        log_event(
            "control_server_gave_up",
            f"control server link {self.name}: {self.policy.limit} losses within {self.policy.window:g} s; not"
            f" restarting it any more (last: {reason}); `kandev up` or a backend restart tries again",
            priority=2, LINK=self.name, REASON=reason, LOSSES_IN_WINDOW=self.policy.recent,
        )
