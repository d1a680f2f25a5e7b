"""The seeded fault schedule of a chaos run (Issue 45 item 1): which faults, in which order, and
their parameters. The same seed gives the same schedule; the streams' own choices (which prompt a
session gets next) come from a second generator seeded from it, so they never shift the faults.

``KANDEV_CHAOS_SEED`` picks the seed (else a fresh one) and ``KANDEV_CHAOS_FAULTS`` the count.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

BACKEND_SIGKILL = "backend_sigkill"
BACKEND_RESTART = "backend_restart"
AGENTCTL_SIGKILL = "agentctl_sigkill"
AGENTCTL_RELOAD = "agentctl_reload"
DISK_FULL = "disk_full"
AGENT_OOM = "agent_oom"
FAULT_KINDS = (BACKEND_SIGKILL, BACKEND_RESTART, AGENTCTL_SIGKILL, AGENTCTL_RELOAD, DISK_FULL, AGENT_OOM)
# A control-server SIGKILL ends every agent and each session is then resumed, an OOM kill ends one
# agent (which is resumed): they weigh less, so a run spends most of its faults with the same agents
# streaming through them.
WEIGHTS = {BACKEND_SIGKILL: 3, BACKEND_RESTART: 3, AGENTCTL_SIGKILL: 1, AGENTCTL_RELOAD: 3, DISK_FULL: 2,
           AGENT_OOM: 1}


@dataclass(frozen=True)
class Fault:
    index: int  # 1-based place in the schedule
    kind: str
    answer_permission: bool  # after this fault, the open permission request is answered


@dataclass(frozen=True)
class Schedule:
    seed: int
    sessions: int  # 4 to 8 sessions stream through the faults
    faults: tuple[Fault, ...]


def seed_from_env() -> int:
    raw = os.environ.get("KANDEV_CHAOS_SEED", "").strip()
    if raw:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"KANDEV_CHAOS_SEED must be an integer, got {raw!r}") from None
    return random.SystemRandom().randrange(1, 2**31)


def count_from_env(default: int) -> int:
    raw = os.environ.get("KANDEV_CHAOS_FAULTS", "").strip()
    try:
        count = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"KANDEV_CHAOS_FAULTS must be an integer from 1, got {raw!r}") from None
    if count < 1:
        raise ValueError(f"KANDEV_CHAOS_FAULTS must be an integer from 1, got {count}")
    return count


def make_schedule(seed: int, count: int) -> Schedule:
    rng = random.Random(seed)
    sessions = rng.randint(4, 8)
    kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
    faults = []
    for i in range(1, count + 1):
        # after each fault the open permission request is answered with odds 0.3: it stays open
        # across three faults on average (a control-server SIGKILL ends it sooner)
        faults.append(Fault(i, rng.choices(kinds, weights)[0], answer_permission=rng.random() < 0.3))
    return Schedule(seed, sessions, tuple(faults))


def prompt_rng(seed: int) -> random.Random:
    """The generator of the streams' prompts (apart from the schedule's)."""
    return random.Random(seed * 7919 + 1)


def next_prompt(rng: random.Random) -> str:
    """A streaming turn: ``/slow N`` (one chunk a second) or ``/flood N`` (as fast as it goes)."""
    if rng.random() < 0.5:
        return f"/slow {rng.randint(4, 15)}"
    return f"/flood {rng.randint(200, 3000)}"
