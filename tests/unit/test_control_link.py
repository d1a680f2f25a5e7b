"""The control-server link's state machine (``daemon.backend.control.link``) on fake clocks.

Issue 11: a control server that dies under a running backend is detected, its sessions made
truthful (``on_lost``), a fresh server started with back-off (1 s, 2 s, 5 s), and after 5 losses
within 5 min the link gives up until ``retry`` (``kandev up``). No processes here: the watch,
the start and the sleep are fakes; the wiring is proven by tests/integration/test_control_server_loss.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from daemon.api.ops import LinkState
from daemon.backend.control.link import Attached, ControlServerLink, CrashLoop, Loss


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeWatch:
    def __init__(self, reason: str = "killed by signal SIGKILL") -> None:
        self.dead = False
        self._reason = reason

    async def gone(self) -> bool:
        return self.dead

    async def reason(self) -> str:
        return self._reason


class Harness:
    """A link whose sleep advances a fake clock, whose start fails while ``failing`` is set."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.sleeps: list[float] = []
        self.started: list[FakeWatch] = []
        self.lost: list[tuple[Any, Loss]] = []
        self.resumed: list[list[str]] = []
        self.failing = False
        self.link = ControlServerLink(
            "survival", start=self.start, on_lost=self.on_lost, on_restarted=self.resumed.append,
            policy=CrashLoop(clock=self.clock), sleep=self.sleep,
        )

    async def sleep(self, seconds: float) -> None:
        if seconds != self.link.watch_interval:
            self.sleeps.append(seconds)
        self.clock.now += seconds
        await asyncio.sleep(0)

    async def start(self) -> Attached:
        if self.failing:
            raise RuntimeError("control server exited with code -9 before it was ready")
        watch = FakeWatch()
        self.started.append(watch)
        return Attached(handle=f"server-{len(self.started)}", client=None, watch=watch)

    async def on_lost(self, attached: Attached, loss: Loss) -> list[str]:
        self.lost.append((attached.handle, loss))
        return [f"session-of-{attached.handle}"]

    async def settle(self, until: Any, turns: int = 2000) -> None:
        for _ in range(turns):
            if until():
                return
            await asyncio.sleep(0)
        raise AssertionError(f"link never reached the expected state; it is {self.link.state}")


def test_crash_loop_backoff_grows_then_gives_up_at_the_limit_within_the_window():
    """Issue 11: back-off 1 s, 2 s, 5 s capped; 5 losses in 5 min -> give up."""
    clock = Clock()
    loop = CrashLoop(clock=clock)
    assert [loop.record() for _ in range(4)] == [1.0, 2.0, 5.0, 5.0]
    assert loop.record() is None  # the fifth loss within the window
    loop.reset()
    assert loop.record() == 1.0


def test_crash_loop_forgets_losses_older_than_the_window():
    clock = Clock()
    loop = CrashLoop(clock=clock)
    for _ in range(4):
        loop.record()
        clock.now += 100.0  # losses at 0, 100, 200, 300 s; now 400 s
    assert loop.recent == 2  # those at 200 and 300 s
    assert loop.record() == 5.0  # a third within the window: no give-up


def test_crash_loop_rejects_a_meaningless_policy():
    with pytest.raises(ValueError):
        CrashLoop(limit=0)
    with pytest.raises(ValueError):
        CrashLoop(backoff=())


def test_loss_is_seen_repaired_and_a_new_server_runs(caplog):
    """Issue 11 scenario A, the link's part: one control_server_lost entry with the reason,
    on_lost called once, a fresh server after the 1 s back-off, the interrupted sessions handed
    to on_restarted (automatic resume) once it runs."""
    async def run() -> Harness:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        assert h.link.state == LinkState.RUNNING
        first.watch.dead = True
        await h.settle(lambda: len(h.started) == 2 and h.link.state == LinkState.RUNNING)
        await h.link.close()
        return h

    with caplog.at_level(logging.INFO, logger="kandev.event"):
        h = asyncio.run(run())
    assert [handle for handle, _ in h.lost] == ["server-1"]
    loss = h.lost[0][1]
    assert loss.reason == "killed by signal SIGKILL" and not loss.at_start
    assert h.sleeps == [1.0]
    assert h.resumed == [["session-of-server-1"]]
    assert h.link.restarts == 1 and h.link.last_loss == loss
    lost_entries = [r for r in caplog.records if getattr(r, "kandev_event", None) == "control_server_lost"]
    assert len(lost_entries) == 1
    assert lost_entries[0].kandev_fields["REASON"] == "killed by signal SIGKILL"


def test_server_that_dies_at_start_every_time_makes_it_give_up_then_retry_brings_one_back():
    """Issue 11 scenario D, the link's part: the loss plus failed starts reach the crash-loop limit;
    then nothing runs (no task, no sleep) until retry, which tries at once; while the server
    still dies, a retry gives up again after the same cycle; once it no longer dies, it runs."""
    async def scenario() -> tuple[Harness, list[float]]:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        h.failing = True
        first.watch.dead = True
        await h.settle(lambda: h.link.state == LinkState.GAVE_UP)
        first_cycle = list(h.sleeps)
        assert h.link._task is None or h.link._task.done()  # idle: nothing left running
        for _ in range(50):
            await asyncio.sleep(0)
        assert h.sleeps == first_cycle
        snapshot = h.link.snapshot()
        assert snapshot["state"] == "gave_up" and snapshot["losses_in_window"] == 5
        assert "exited with code -9" in snapshot["gave_up"]["reason"] and snapshot["gave_up"]["at_start"]
        assert h.link.retry()  # still failing: the same cycle again, then gave_up again
        assert h.link.state == LinkState.RESTARTING
        await h.settle(lambda: h.link.state == LinkState.GAVE_UP)
        assert h.sleeps == first_cycle * 2
        h.failing = False
        assert h.link.retry()
        await h.settle(lambda: h.link.state == LinkState.RUNNING)
        assert len(h.started) == 2
        await h.link.close()
        return h, first_cycle

    h, cycle = asyncio.run(scenario())
    assert cycle == [1.0, 2.0, 5.0, 5.0]
    assert len(h.lost) == 1  # on_lost once, for the server that was running
    assert h.resumed == [["session-of-server-1"]]  # the interrupted session, once a server runs again


def test_retry_only_after_giving_up():
    async def run() -> None:
        h = Harness()
        h.link.attach(await h.start())
        assert not h.link.retry()
        assert h.link.state == LinkState.RUNNING
        await h.link.close()

    asyncio.run(run())


def test_superseded_server_is_neither_watched_nor_restarted():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.3: a server another credential holder adopted is not ours:
    its exit afterwards is no loss of ours."""
    async def run() -> Harness:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        h.link.release()
        first.watch.dead = True
        for _ in range(50):
            await asyncio.sleep(0)
        return h

    h = asyncio.run(run())
    assert h.link.state == LinkState.SUPERSEDED
    assert h.lost == [] and len(h.started) == 1


def test_closed_link_does_not_treat_the_shutdown_as_a_loss():
    async def run() -> Harness:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        await h.link.close()
        first.watch.dead = True
        for _ in range(50):
            await asyncio.sleep(0)
        h.link.attach(await h.start())  # ignored once closed
        return h

    h = asyncio.run(run())
    assert h.lost == [] and h.link.state == LinkState.RUNNING and h.link._task is None


def test_a_failed_first_start_counts_as_a_loss_and_the_link_keeps_trying():
    """Issue 11 scenario D at backend start: no server could be started by startup recovery."""
    async def run() -> Harness:
        h = Harness()
        h.link.start_failed("start failed: control server exited with code -9 before it was ready")
        assert h.link.state == LinkState.RESTARTING and h.link.last_loss.at_start
        await h.settle(lambda: h.link.state == LinkState.RUNNING)
        await h.link.close()
        return h

    h = asyncio.run(run())
    assert h.sleeps == [1.0] and len(h.started) == 1 and h.lost == []


def test_a_replacement_the_backend_chose_is_no_loss():
    """Issue 15 with Issue 11: replacing a server too old to reload (``replace``) stops watching it
    first, so its end is no loss (no on_lost, nothing counted, no control_server_lost entry); the
    successor comes from ``start``, as a restart's would, and is watched. A link that is not
    running replaces nothing."""
    async def run() -> tuple[Harness, list[str], list[LinkState]]:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        retired: list[str] = []
        seen: list[LinkState] = []

        async def retire(attached: Attached) -> None:
            seen.append(h.link.state)
            attached.watch.dead = True  # it exits, as ownership_shutdown makes it
            await asyncio.sleep(0)
            retired.append(attached.handle)

        assert await h.link.replace(retire) is True
        assert h.link.state == LinkState.RUNNING and h.link.attached is not None
        assert h.link.attached.handle == "server-2"
        for _ in range(50):  # the old watch, had it gone on, would have seen the exit by now
            await asyncio.sleep(0)
        h.link.release(LinkState.NONE)
        assert await h.link.replace(retire) is False  # not running: nothing done
        await h.link.close()
        return h, retired, seen

    h, retired, seen = asyncio.run(run())
    assert retired == ["server-1"] and seen == [LinkState.REPLACING]
    assert h.lost == [] and h.link.policy.recent == 0 and h.link.last_loss is None
    assert h.link.replacements == 1 and h.link.restarts == 0 and h.sleeps == []


def test_a_replacement_whose_start_fails_is_a_loss_at_start_and_the_link_keeps_trying():
    async def run() -> Harness:
        h = Harness()
        first = await h.start()
        h.link.attach(first)
        h.failing = True

        async def retire(attached: Attached) -> None:
            attached.watch.dead = True

        with pytest.raises(RuntimeError):
            await h.link.replace(retire)
        assert h.link.last_loss is not None and h.link.last_loss.at_start
        assert "replacement" in h.link.last_loss.reason
        h.failing = False
        await h.settle(lambda: h.link.state == LinkState.RUNNING and len(h.started) == 2)
        await h.link.close()
        return h

    h = asyncio.run(run())
    assert h.lost == [] and h.sleeps == [1.0] and h.link.restarts == 1
