"""Issue 2 scenario A, Issue 2 scenario B and Issue 2 scenario C without a service manager: real daemons, real agent, real SQLite.

A: capability enabled, backend SIGKILLed mid-turn → the same agent process is
   re-tracked and finishes its turn; transcript complete, once, in order.
B: the same with a graceful ``kandev down``: nothing is stopped.
C: capability disabled: the agent dies with the backend and the session is
   not shown as running after a restart.
"""

from __future__ import annotations

import os
import signal

import pytest

from daemon.host import process_start
from tests.support.processes import alive, group_alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

N = 40  # long enough that the turn outlives the restart even on a loaded machine
EXPECTED = [f"{i}/{N} " for i in range(1, N + 1)]
pytestmark = pytest.mark.timeout(240)


def _start_slow_turn(k):  # -> (task_id, session_id, agent pid, agent start time)
    task, sid = k.start_session("survival")
    k.cli("prompt", sid, f"/slow {N}")
    show = wait_until(lambda: s if len(agent_chunks(s := k.show(sid))) >= 3 else None, timeout=30)
    assert show["state"] == "RUNNING"
    return task, sid, show["agent_pid"], show["agent_pid_start_time"]


def _assert_retracked_and_finishes(k, task: str, sid: str, pid: int, start: float) -> None:
    # AC-EXECUTORS-SURVIVAL-001.4: same process (pid + start time), no new spawn, no resume.
    show = wait_until(lambda: s if (s := k.show(sid))["retracked"] else None, timeout=5)
    assert show["state"] == "RUNNING"  # AC-EXECUTORS-SURVIVAL-003.3
    assert show["agent_pid"] == pid and show["agent_pid_start_time"] == start
    # the process recorded, by the stamp a step of the wall clock cannot move (boot id, start ticks)
    assert show["agent_pid_start_stamp"] == process_start.stamp(pid)
    # AC-EXECUTORS-SURVIVAL-003.4: the open turn was not abandoned.
    assert show["turns"][-1]["state"] == "open"
    # AC-EXECUTORS-SURVIVAL-003.2 / AC-EXECUTORS-SURVIVAL-003.5: the task stays in progress, not interrupted.
    board = k.cli("board")
    assert task in board["running"]
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=N + 30)
    # AC-EXECUTORS-SURVIVAL-001.5: nothing lost, nothing duplicated, in order.
    assert agent_chunks(done) == EXPECTED
    assert done["turns"][-1]["state"] == "finished"
    assert done["turns"][-1]["stop_reason"] == "end_turn"
    # No provider resume was sent: the transcript holds no replayed history.
    assert [m["kind"] for m in done["transcript"]].count("prompt") == 1
    assert task in k.cli("board")["turn_finished"]


def test_scenario_a_backend_sigkill_agent_survives_and_is_retracked(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-001.2, AC-EXECUTORS-SURVIVAL-001.4, AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-002.1, AC-EXECUTORS-SURVIVAL-003.2, AC-EXECUTORS-SURVIVAL-003.3, AC-EXECUTORS-SURVIVAL-003.4, AC-EXECUTORS-SURVIVAL-003.5."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    assert st["capability"]["state"] == "enabled"
    assert st["control_server"]["mode"] == "detached"
    server_pid = st["control_server"]["pid"]
    task, sid, pid, start = _start_slow_turn(k)
    backend = st["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    assert alive(pid) and alive(server_pid)  # AC-EXECUTORS-SURVIVAL-001.2
    st2 = k.up()
    assert st2["backend"]["pid"] != backend
    assert st2["adoption"]["outcome"] == "adopted"
    assert st2["control_server"]["pid"] == server_pid
    assert st2["recovery"]["retracked"] == 1
    _assert_retracked_and_finishes(k, task, sid, pid, start)


def test_scenario_b_graceful_down_sends_no_stop(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-001.1: graceful shutdown leaves server and agents running, untouched."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    server_pid = st["control_server"]["pid"]
    task, sid, pid, start = _start_slow_turn(k)
    instance = k.show(sid)["instance_id"]
    down = k.cli("down")
    assert down["stopped"] and down["detached"]
    assert alive(pid) and alive(server_pid)
    st2 = k.up()
    assert st2["adoption"]["outcome"] == "adopted"
    assert st2["recovery"]["stopped_orphans"] == 0
    assert k.show(sid)["instance_id"] == instance  # the same instance, never re-created
    _assert_retracked_and_finishes(k, task, sid, pid, start)


def test_scenario_c_disabled_agent_dies_with_backend(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-005.1, AC-EXECUTORS-SURVIVAL-005.2: disabled by default; the agent dies with the backend."""
    # nothing set but automatic resume (on by default): the capability is off by default, and the
    # session is looked at as the restart left it
    k = kandev_factory(KANDEV_FEATURES_AUTO_RESUME="false")
    st = k.up()
    assert st["capability"]["state"] == "disabled"
    assert st["control_server"]["mode"] == "child"
    server_pid = st["control_server"]["pid"]
    task, sid, pid, _ = _start_slow_turn(k)
    pgid = os.getpgid(pid)
    assert pgid == pid  # the agent leads its own process group
    os.kill(st["backend"]["pid"], signal.SIGKILL)
    wait_until(lambda: not group_alive(pgid), timeout=5)
    wait_until(lambda: not alive(server_pid), timeout=5)
    st2 = k.up()
    assert st2["adoption"]["outcome"] == "disabled"
    assert st2["recovery"]["retracked"] == 0
    show = k.show(sid)
    assert show["state"] != "RUNNING" and not show["retracked"]
    assert show["recoverable"] and show["resume_token"]
    assert show["turns"][-1]["state"] == "abandoned"
    board = k.cli("board")
    assert task not in board["running"]
