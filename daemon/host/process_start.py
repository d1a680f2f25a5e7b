"""When a process started, as an identity no step of the wall clock can change.

A pid names a process only until it exits; with the process's start it names one process for
good. psutil's ``create_time()`` gives that start in wall-clock seconds: the kernel's count of
clock ticks from boot to the process's start, plus the boot time in /proc/stat. The kernel derives
that boot time from the wall clock at every read, so a step of the wall clock (NTP correcting a
clock at boot, a virtual machine restored from a snapshot, ``date -s``) moves the create_time() of
every running process by the size of the step: compared with a value read before the step, a
process that never stopped looks like another one.

The ticks themselves never move. ``read(pid)`` takes them, with the process's state, from
/proc/<pid>/stat: within one boot, equal ticks and pid are the same process, whatever the clock
did meanwhile. Use them where both sides of a comparison are read on this machine and this boot.

A start kept longer (a database row a later backend checks, perhaps after a reboot) is a
``stamp(pid)``: the kernel's boot id and the ticks. Two stamps of one pid are equal only for the
same process of the same boot.
"""

from __future__ import annotations

import functools
from typing import NamedTuple


class ProcessStart(NamedTuple):
    """A process as /proc/<pid>/stat shows it: its state letter and its start in clock ticks
    since boot."""

    state: str
    ticks: int

    @property
    def exited(self) -> bool:
        """A zombie (exited, not yet reaped) or dead: nothing of it runs any more."""
        return self.state in ("Z", "X", "x")


def read(pid: int) -> ProcessStart | None:
    """The state and start of process ``pid``; None when no process has that pid. Raises
    ``PermissionError`` when /proc does not let this process look (``hidepid``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    # the fields after it start after its last ")". Field 3 is the state, field 22 the start.
    fields = data[data.rindex(b")") + 2:].split()
    return ProcessStart(fields[0].decode("ascii", "replace"), int(fields[19]))


@functools.cache
def boot_id() -> str:
    """The kernel's id of this boot (a random UUID, new at every boot)."""
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        return f.read().strip()


def stamp(pid: int) -> str | None:
    """Process ``pid``'s start as ``<boot id>:<ticks>``, unchanged for its whole life whatever the
    wall clock does and never repeated by another process, in this boot or a later one; None when
    no process has that pid (a zombie still has one). Raises ``OSError`` when /proc cannot be read."""
    seen = read(pid)
    return None if seen is None else stamp_of(seen.ticks)


def stamp_of(ticks: int) -> str:
    """The stamp of a process of this boot that started ``ticks`` clock ticks after it."""
    return f"{boot_id()}:{ticks}"


def of_this_boot(start_stamp: str) -> bool:
    """Whether ``start_stamp`` was taken in this boot (a process of an earlier boot is gone).
    Raises ``OSError`` when the boot id cannot be read."""
    return start_stamp.startswith(f"{boot_id()}:")
