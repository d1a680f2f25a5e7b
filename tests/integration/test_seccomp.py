"""The agents' system-call filter from inside real agents: Issue 44 scenario E through the real daemons.

From inside a mock agent (``/sh``): ``unshare -Ur true`` fails, an io_uring set-up fails, ``add_key``
fails, ``/proc/self/status`` says ``Seccomp: 2``, while git, node and python run (threads and
subprocesses included: ``clone3`` fails with ENOSYS and they fall back to ``clone``). The filter
holds for the agent re-tracked after a backend SIGKILL (survival on), for a resumed agent, for the
survivor after ``kandev agentctl reload`` and for an agent the reloaded server starts. ``kandev
status`` and ``kandev doctor`` name the filter.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from daemon.agentctl.sandbox import seccomp_filter
from tests.support.kandev import Kandev
from tests.support.processes import alive
from tests.support.sessions import new_task, start
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

# Each line a verdict; the system call numbers are x86-64's (io_uring_setup 425, add_key 248).
PROBE = r"""
grep '^Seccomp:' /proc/self/status | tr -d '\t '
unshare -Ur true 2>/dev/null; echo "unshare=$?"
python3 -c '
import ctypes, errno, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
def err(nr, *args):
    ctypes.set_errno(0)
    return "ok" if libc.syscall(nr, *args) >= 0 else errno.errorcode[ctypes.get_errno()]
print("io_uring=" + err(425, 8, ctypes.create_string_buffer(256)))
print("add_key=" + err(248, b"user", b"kandev", b"v", 1, -3))
t = threading.Thread(target=print, args=("python_thread=ok",)); t.start(); t.join()
print("python_subprocess=" + str(subprocess.run(["true"]).returncode))
'
git --version >/dev/null && echo git=ok
node -e 'require("child_process").execFileSync("true"); console.log("node=ok")'
""".strip()

HELD = {"Seccomp:2", "unshare=1", "io_uring=EPERM", "add_key=EPERM", "python_thread=ok", "python_subprocess=0",
        "git=ok", "node=ok"}


def says(k: Kandev, sid: str, prompt: str) -> str:
    k.cli("prompt", sid, prompt, "--wait")
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


def assert_filtered(k: Kandev, sid: str, when: str) -> None:
    said = says(k, sid, "/sh " + PROBE)
    assert said.startswith("sh: exit=0\n"), (when, said)
    assert set(said.splitlines()[1:]) == HELD, (when, said)


def _survivor(k: Kandev, sid: str, before: dict[str, Any]) -> None:
    show = k.show(sid)
    assert (show["agent_pid"], show["agent_pid_start_time"]) == (before["agent_pid"], before["agent_pid_start_time"])


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the probe uses x86-64 system call numbers")
def test_scenario_e_the_filter_holds_after_retrack_reload_and_resume(kandev_factory: Any) -> None:
    """Issue 44 scenario E: the filter from inside a mock agent at its start, after a re-track
    (backend SIGKILL, survival on), after ``kandev agentctl reload`` (the survivor, and an agent the
    reloaded server starts) and after a resume; ``kandev status`` shows the filter's version."""
    k = kandev_factory("home", "[features]\nagent_survival = true\n")
    k.up()
    task, _ws = new_task(k, "seccomp")
    sid = start(k, task)
    before = k.show(sid)
    assert_filtered(k, sid, "at start")
    sandbox = k.status()["sandbox"]
    assert sandbox["sandboxed"] is True and sandbox["seccomp"] == seccomp_filter.describe(), sandbox
    assert seccomp_filter.describe() in k.human("status").stdout
    assert seccomp_filter.describe() in k.human("doctor").stdout

    backend = k.status()["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=30)
    k.up()
    wait_until(lambda: k.show(sid)["retracked"], timeout=60)
    _survivor(k, sid, before)
    assert_filtered(k, sid, "re-tracked")

    server = k.status()["control_server"]["pid"]
    reloaded = k.cli("agentctl", "reload", timeout=200)
    assert reloaded["outcome"] == "reexecuted" and reloaded["pid"] == server
    _survivor(k, sid, before)
    assert_filtered(k, sid, "survived a reload")
    other_task, _ = new_task(k, "after the reload")
    assert_filtered(k, start(k, other_task), "started by the reloaded server")

    k.cli("prompt", sid, "/exit 5")
    wait_until(lambda: k.show(sid)["state"] == "FAILED", timeout=30)
    resumed = k.cli("resume", sid, timeout=180)
    assert resumed["loaded"] is True and k.show(sid)["agent_pid"] != before["agent_pid"]
    assert_filtered(k, sid, "resumed")
