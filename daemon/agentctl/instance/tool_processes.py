"""The tool processes a cancelled turn leaves behind in its agent's sandbox, and their end.

``session/cancel`` (ACP) asks the agent to end its turn, the tools it runs included. What an agent
really does with them is its own affair: a tool that put itself in the background (``cmd &``,
``nohup``, a double fork), left its process group (``setsid``) or that the agent simply forgot
keeps running after the agent answered ``cancelled``. So, once a turn the backend cancelled has
ended, the control server ends what the turn left (``end_leftovers``):

- the sandbox's processes are the descendants of the agent's ``bwrap`` (an orphan is re-parented
  to bwrap's init inside the sandbox's pid namespace, still a descendant); without a sandbox
  (``agents.sandbox = "off"``) only the agent's own descendants can be found (an orphan then
  belongs to the host's init, and nothing tells it from any other process of the host);
- a leftover is such a process that started during the turn (its start, in clock ticks since boot,
  not before the turn's: ``boot_ticks`` when the prompt was sent) and is outside the agent's own
  process group. That group is what kandev started (bwrap, the agent) and the helpers the agent
  keeps for itself (MCP servers, the CLI an adapter drives), which a cancel must not kill. A tool
  has a group of its own: shells' job control, ``node-pty`` terminals, Gemini CLI's shell tool and
  the mock agent's ``/sh`` each start one per command, and ``setsid`` makes one. A tool an agent
  runs inside its own group and leaves running after a cancel stays (the agent's to end);
  ``session stop`` kills the agent's whole group and, with its sandbox's init, every process of
  the pid namespace;
- each leftover gets SIGTERM, then, after up to ``LEFTOVER_GRACE`` s, SIGKILL, and what they
  started meanwhile SIGKILL too; psutil signals a process only while its (pid, start) identity
  still holds. The turn's end is reported once this is done, so a cancelled turn that shows as
  ended has no tool process left.

Background servers the agent started in an earlier turn are not the cancelled turn's: they stay.

A stop (``kill_group_and_tools``) kills the agent's group; a sandboxed agent's pid namespace dies
with it, every process in it included. An unsandboxed agent has no such namespace, so the tool
processes below it that left its group (any turn's) get the same SIGTERM, and SIGKILL once the
group has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

import psutil

from daemon.core.journal import log_event
from daemon.host import process_start

if TYPE_CHECKING:
    from daemon.agentctl.instance.process import AgentProcess, InstanceSpec

log = logging.getLogger("kandev.agentctl.tool_processes")
T = TypeVar("T")

LEFTOVER_GRACE = 1.0
"""Seconds a leftover tool process has between SIGTERM and SIGKILL."""
KILL_ROUNDS = 3
"""Looks for leftovers started while the first ones were being ended (a tool that forks on SIGTERM)."""
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def boot_ticks() -> int:
    """Now, in the clock ticks since boot in which /proc gives a process's start."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLOCK_TICKS)


def leftovers(leader: psutil.Process, agent_group: int, since_ticks: int) -> list[psutil.Process]:
    """The processes below ``leader`` started at or after ``since_ticks`` outside the process
    group ``agent_group`` (blocking: reads /proc)."""
    try:
        below = leader.children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for proc in below:
        try:
            start = process_start.read(proc.pid)
            if start is None or start.exited or start.ticks < since_ticks:
                continue
            if os.getpgid(proc.pid) == agent_group:
                continue
        except (OSError, psutil.Error):
            continue
        found.append(proc)
    return found


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


async def end_leftovers(leader: psutil.Process, agent_group: int, since_ticks: int,
                        grace: float = LEFTOVER_GRACE) -> list[int]:
    """SIGTERM every leftover, SIGKILL what is still there after ``grace`` s, then SIGKILL what
    they started meanwhile (up to ``KILL_ROUNDS`` looks); the pids of every leftover found."""
    found = await asyncio.to_thread(leftovers, leader, agent_group, since_ticks)
    if not found:
        return []
    ended = {p.pid for p in found}
    _signal_all(found, signal.SIGTERM)
    _gone, alive = await asyncio.to_thread(psutil.wait_procs, found, grace)
    _signal_all(alive, signal.SIGKILL)
    for _ in range(KILL_ROUNDS):
        more = await asyncio.to_thread(leftovers, leader, agent_group, since_ticks)
        if not more:
            break
        ended.update(p.pid for p in more)
        _signal_all(more, signal.SIGKILL)
        await asyncio.to_thread(psutil.wait_procs, more, grace)
    return sorted(ended)


class TurnMarks(Protocol):
    """What an instance's ``Turns`` note for this module: the open turn's start, the cancelled turn."""

    started_ticks: int | None
    cancelled: str | None


class Owner(Protocol):
    """What ``answered`` reads of the instance whose turn it is."""

    @property
    def turns(self) -> TurnMarks: ...
    @property
    def group(self) -> AgentProcess: ...
    @property
    def stop_signal(self) -> asyncio.Event: ...
    @property
    def spec(self) -> InstanceSpec: ...


async def kill_group_and_tools(group: AgentProcess) -> str | None:
    """``group.kill_group()`` (its result), and for an unsandboxed agent the processes below it
    outside its group too (see the module docstring)."""
    apart: list[psutil.Process] = []
    if not group.sandboxed and group.psproc is not None and group.pid is not None:
        apart = await asyncio.to_thread(leftovers, group.psproc, group.pid, 0)
    _signal_all(apart, signal.SIGTERM)
    ended = await group.kill_group()
    _signal_all(apart, signal.SIGKILL)
    return ended


async def answered(answer: Awaitable[T], turn_id: str, owner: Owner) -> T:
    """The agent's answer to ``turn_id``'s ``session/prompt``, returned (or raised) once, for a turn
    a cancel was sent for (``turns.cancelled``), what it left is ended: the caller reports the
    turn's end after this. Not while the instance stops (its stop ends the whole sandbox)."""
    try:
        return await answer
    finally:
        turns = owner.turns
        if turns.cancelled == turn_id and not owner.stop_signal.is_set():
            await _end_for(turn_id, turns.started_ticks, owner.group, owner.spec)


async def _end_for(turn_id: str, since: int | None, group: AgentProcess, spec: InstanceSpec) -> None:
    leader = group.psproc
    if leader is None or group.pid is None or since is None:
        return  # no identity, or a turn carried over a re-exec (its start is not known here)
    try:
        ended = await end_leftovers(leader, group.pid, since)
    except Exception:
        log.exception("instance %s: ending the tool processes turn %s left failed", spec.instance_id, turn_id)
        return
    if ended:
        log_event("turn_tools_ended", f"instance {spec.instance_id}: turn {turn_id} was cancelled and left"
                  f" {len(ended)} tool process(es) running: ended", INSTANCE_ID=spec.instance_id,
                  SESSION_ID=spec.session_id, TURN_ID=turn_id, PIDS=" ".join(map(str, ended)))
