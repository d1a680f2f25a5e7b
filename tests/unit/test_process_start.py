"""``daemon.host.process_start``: a process's state and start ticks from /proc/<pid>/stat, read right
whatever the process calls itself (its name is attacker input: an agent sets its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from daemon.host import process_start
from tests.support.waiting import wait_until

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def test_this_process_is_running_and_its_ticks_are_its_boot_relative_start() -> None:
    seen = process_start.read(os.getpid())
    assert seen is not None and not seen.exited and seen.state in "RS"
    wall = psutil.boot_time() + seen.ticks / CLOCK_TICKS
    assert abs(wall - psutil.Process().create_time()) < 0.02
    assert process_start.read(os.getpid()) == seen  # the same on every read


def test_a_name_with_parentheses_and_spaces_does_not_shift_the_fields() -> None:
    code = ("import sys, time\n"
            "open('/proc/self/comm', 'w').write(') Z 1 2 (x')\n"
            "print('named', flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "named"
        seen = process_start.read(proc.pid)
        assert seen is not None and seen.state in "RS" and not seen.exited
        assert seen.ticks == process_start.read(proc.pid).ticks  # type: ignore[union-attr]
        assert abs(psutil.boot_time() + seen.ticks / CLOCK_TICKS - psutil.Process(proc.pid).create_time()) < 0.02
    finally:
        proc.kill()
        proc.wait()


def test_an_exited_child_not_yet_reaped_has_exited_and_a_reaped_one_is_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    seen = wait_until(lambda: s if (s := process_start.read(proc.pid)) is not None and s.exited else None, timeout=30)
    assert seen.state == "Z"
    proc.wait()
    assert process_start.read(proc.pid) is None


def test_a_stamp_is_the_boot_id_and_the_start_ticks_and_names_no_other_process() -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    seen = process_start.read(os.getpid())
    assert seen is not None
    mine = process_start.stamp(os.getpid())
    assert mine == f"{boot}:{seen.ticks}" and process_start.of_this_boot(mine)
    assert not process_start.of_this_boot(f"00000000-0000-0000-0000-000000000000:{seen.ticks}")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_start.stamp(proc.pid) is None  # reaped: no process has the pid
