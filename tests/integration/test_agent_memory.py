"""Issue 45 scenario B: each agent runs in a memory cgroup of its own, bounded by ``agents.max_memory``;
an agent that allocates past its bound is killed alone and reported ``agent_killed`` / ``memory``
(journal, ``session show``, the board) while a neighbour keeps streaming and the control server keeps
running; a reload of the control server keeps each agent in its cgroup.

The real daemons as root, on this host's memory controller (cgroup v1 here: hybrid; the v2 path is
tested on a fake cgroupfs in tests/unit/test_memory_cgroups.py). The mock agent's ``/alloc N``
allocates and touches N MiB in the agent itself.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.kandev import Kandev
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(300)
BOUND = "192M"
BOUND_BYTES = 192 * 1024 * 1024


def memory_cgroup(pid: int) -> str | None:
    """Process ``pid``'s cgroup of the memory controller (v1 line, else the v2 one)."""
    text = Path(f"/proc/{pid}/cgroup").read_text()
    lines = [line.split(":", 2) for line in text.splitlines()]
    v1 = [path for _, controllers, path in lines if "memory" in controllers.split(",")]
    v2 = [path for hid, controllers, path in lines if hid == "0" and controllers == ""]
    return (v1 or v2 or [None])[0]


V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()


def cgroup_dir(path: str) -> Path:
    return Path(("/sys/fs/cgroup/memory" if V1 else "/sys/fs/cgroup") + path)


def limit_of(path: str) -> int:
    return int((cgroup_dir(path) / ("memory.limit_in_bytes" if V1 else "memory.max")).read_text())


def new_session(k: Kandev, root: Path, name: str) -> tuple[str, str]:
    ws = root / f"ws-{name}"
    ws.mkdir()
    task = k.cli("task", "create", "--title", name, "--workspace", str(for_agent(ws)))["task_id"]
    sid = k.cli("session", "start", task)["session_id"]
    k.show(sid)
    return task, sid


def bounded_home(kandev_factory: Any, config: str) -> tuple[Kandev, dict[str, Any]]:
    k = kandev_factory(config_text=config)
    status = k.up()
    memory = status["memory"]
    if not memory["bounded"]:
        if os.environ.get("CI"):
            pytest.fail(f"agents' memory is unbounded on this CI host: {memory['reason']}")
        pytest.skip(f"agents' memory cannot be bounded here: {memory['reason']}")
    return k, status


def agent_cgroup_of(k: Kandev, sid: str, server_pid: int) -> str:
    """The agent's memory cgroup, checked to be its own below the control server's."""
    leader = int(k.show(sid)["agent_pid"])
    path = memory_cgroup(leader)
    server = memory_cgroup(server_pid)
    assert path and server, (path, server)
    base = server.removesuffix("/agentctl").rstrip("/")  # v2: the server sits in a leaf of its cgroup
    assert re.fullmatch(re.escape(base) + r"/agent-[0-9a-f]{32}", path), (path, server)
    for p in [psutil.Process(leader), *psutil.Process(leader).children(recursive=True)]:
        assert memory_cgroup(p.pid) == path, p  # everything of the agent is inside
    return path


def text_of(k: Kandev, sid: str) -> str:
    return "".join(m["text"] for m in k.transcript(sid) if m["kind"] == "agent_message_chunk")


def test_issue_45_scenario_b_an_agent_past_its_memory_bound_is_killed_alone(kandev_factory: Any,
                                                                             short_tmp: Path) -> None:
    """Issue 45 scenario B: with ``agents.max_memory`` 192M the agent of session A allocates 1 GiB
    and is killed by its bound alone: A is FAILED with ``agent_killed: memory`` as its error, its
    transcript says ``agent_killed``, the board puts its task under needs attention naming
    ``max_memory``, the journal says ``agent_killed`` ``reason=memory``; B streams every chunk of its
    turn meanwhile, the control server keeps its pid, and A's cgroup is removed."""
    k, status = bounded_home(kandev_factory, f'[agents]\nmax_memory = "{BOUND}"\n')
    server_pid = int(status["control_server"]["pid"])
    assert status["memory"]["max_memory"] == BOUND_BYTES
    task_a, a = new_session(k, short_tmp, "a")
    _, b = new_session(k, short_tmp, "b")
    cgroup_a = agent_cgroup_of(k, a, server_pid)
    cgroup_b = agent_cgroup_of(k, b, server_pid)
    assert cgroup_a != cgroup_b
    assert limit_of(cgroup_a) == limit_of(cgroup_b) == BOUND_BYTES

    streaming = k.popen("prompt", b, "/slow 12", "--wait", json_output=True)
    wait_until(lambda: text_of(k, b).startswith("1/12 "), timeout=60, message="B never started streaming")
    k.run("prompt", a, "/alloc 1024", "--wait", timeout=120)
    wait_until(lambda: k.show(a)["state"] == "FAILED", timeout=60, message="A was not failed")
    assert streaming.poll() is None, "B's turn should still be streaming when A is killed"
    shown = k.show(a)
    assert (shown.get("last_error") or "").startswith("agent_killed: memory"), shown
    assert "192 MiB" in shown["last_error"], shown
    killed = [m for m in k.transcript(a) if m["kind"] == "agent_killed"]
    assert len(killed) == 1 and "memory bound" in killed[0]["text"], killed
    assert "alloc: 1024 MiB" not in text_of(k, a)
    human = k.human("session", "show", a).stdout
    assert "Last error" in human and human.count("agent_killed: memory") == 2, human  # header and transcript

    assert streaming.wait(timeout=120) == 0
    assert text_of(k, b) == "".join(f"{i}/12 " for i in range(1, 13))
    assert k.show(b)["state"] == "WAITING_FOR_INPUT"
    assert k.cli("prompt", b, "still here", "--wait")["stop_reason"] == "end_turn"
    assert task_a in k.cli("board")["needs_attention"]
    row = next(t for t in k.cli("task", "list")["tasks"] if t["task_id"] == task_a)
    assert row["attention"]["reason"] == "failed" and "max_memory" in row["attention"]["hint"], row
    assert "agents.mock.max_memory" in k.human("board").stdout

    log = (k.home / "logs" / "agentctl.log").read_text()
    lines = [line for line in log.splitlines() if " agent_killed " in line]
    assert len(lines) == 1 and "reason=memory" in lines[0] and f"max_memory={BOUND_BYTES}" in lines[0], lines
    assert psutil.pid_exists(server_pid) and int(k.status()["control_server"]["pid"]) == server_pid
    wait_until(lambda: not cgroup_dir(cgroup_a).exists(), timeout=30, message=f"{cgroup_a} was not removed")
    assert cgroup_dir(cgroup_b).exists()
    k.cli("session", "stop", b)
    wait_until(lambda: not cgroup_dir(cgroup_b).exists(), timeout=30, message=f"{cgroup_b} was not removed")


def test_issue_45_scenario_b_a_reload_keeps_each_agent_in_its_cgroup(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 45 scenario B (reloads): after ``kandev agentctl reload`` (the control server re-executes in
    place) the agent is still in its own cgroup with the per-agent bound (``[agents.mock] max_memory``
    over ``agents.max_memory``), an allocation within it succeeds, and one past it is still reported
    ``agent_killed`` / ``memory`` by the new image, which removes the cgroup."""
    k, status = bounded_home(kandev_factory, f'[agents]\nmax_memory = "2G"\n[agents.mock]\nmax_memory = "{BOUND}"\n')
    server_pid = int(status["control_server"]["pid"])
    _, a = new_session(k, short_tmp, "a")
    before = agent_cgroup_of(k, a, server_pid)
    k.cli("agentctl", "reload", timeout=120)
    assert int(k.status()["control_server"]["reexec_count"]) >= 1
    assert agent_cgroup_of(k, a, server_pid) == before and limit_of(before) == BOUND_BYTES
    assert k.cli("prompt", a, "/alloc 32", "--wait")["stop_reason"] == "end_turn"
    k.run("prompt", a, "/alloc 1024", "--wait", timeout=120)
    wait_until(lambda: k.show(a)["state"] == "FAILED", timeout=60, message="the agent was not failed")
    assert (k.show(a).get("last_error") or "").startswith("agent_killed: memory"), k.show(a)
    assert int(k.status()["control_server"]["pid"]) == server_pid
    wait_until(lambda: not cgroup_dir(before).exists(), timeout=30, message=f"{before} was not removed")


def test_issue_45_scenario_b_a_tool_past_the_bound_ends_its_whole_agent(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 45 scenario B (the agent's tools count too): a process the agent starts (its ``/sh``) that
    allocates past the bound is killed and its agent with it, as ``memory.oom.group`` does on cgroup
    v2 (on v1 the control server ends the rest of the cgroup when the kernel says it ran out); the
    session says ``agent_killed: memory``; nothing of the agent is left."""
    k, status = bounded_home(kandev_factory, f'[agents]\nmax_memory = "{BOUND}"\n')
    _, a = new_session(k, short_tmp, "a")
    path = agent_cgroup_of(k, a, int(status["control_server"]["pid"]))
    leader = int(k.show(a)["agent_pid"])
    members = [leader, *(p.pid for p in psutil.Process(leader).children(recursive=True))]
    hog = "python3 -c 'b = bytearray(1 << 30); b[::4096] = bytes(len(b) // 4096); print(\"survived\")'"
    k.run("prompt", a, "/sh " + hog, "--wait", timeout=120)
    wait_until(lambda: k.show(a)["state"] == "FAILED", timeout=60, message="the agent was not ended")
    assert (k.show(a).get("last_error") or "").startswith("agent_killed: memory"), k.show(a)
    assert "survived" not in text_of(k, a)
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in members), timeout=30, message="agent processes left")
    wait_until(lambda: not cgroup_dir(path).exists(), timeout=30, message=f"{path} was not removed")


def test_issue_45_scenario_b_survival_and_re_tracking_keep_the_agent_in_its_cgroup(kandev_factory: Any,
                                                                                   short_tmp: Path) -> None:
    """Issue 45 scenario B (survival, re-tracking): with survival on, the backend SIGKILLed and started
    again re-tracks the agent, which is still in its own cgroup with its bound; going past it is still
    reported ``agent_killed`` / ``memory`` by the control server that survived."""
    k, status = bounded_home(kandev_factory, f'[features]\nagent_survival = true\n[agents]\nmax_memory = "{BOUND}"\n')
    server_pid = int(status["control_server"]["pid"])
    _, a = new_session(k, short_tmp, "a")
    before = agent_cgroup_of(k, a, server_pid)
    backend = int(status["backend"]["pid"])
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(backend) or psutil.Process(backend).status() == psutil.STATUS_ZOMBIE,
               timeout=10)
    again = k.up()
    assert again["recovery"]["retracked"] == 1 and int(again["control_server"]["pid"]) == server_pid
    assert k.show(a)["retracked"]
    assert agent_cgroup_of(k, a, server_pid) == before and limit_of(before) == BOUND_BYTES
    k.run("prompt", a, "/alloc 1024", "--wait", timeout=120)
    wait_until(lambda: k.show(a)["state"] == "FAILED", timeout=60, message="the agent was not failed")
    assert (k.show(a).get("last_error") or "").startswith("agent_killed: memory"), k.show(a)
    wait_until(lambda: not cgroup_dir(before).exists(), timeout=30, message=f"{before} was not removed")


@pytest.mark.parametrize(("config", "key", "value"), [
    ('[agents]\nmax_memory = "10M"\n', "agents.max_memory", '"10M"'),
    ('[agents]\nmax_memory = "100000T"\n', "agents.max_memory", '"100000T"'),
    ('[agents.mock]\nmax_memory = "1K"\n', "agents.mock.max_memory", "'1K'"),
])
def test_issue_45_scenario_b_an_out_of_range_bound_stops_kandev_up(kandev_factory: Any, config: str, key: str,
                                                                   value: str) -> None:
    """Issue 45 scenario B: a bound below 64 MiB or above the host's RAM refuses ``kandev up`` before
    anything starts, naming the key, the value and the range."""
    k = kandev_factory(config_text=config)
    done = k.run("up", timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0 and key in said and value in said and "64M.." in said, said
    assert not (k.home / "run" / "backend.sock").exists()
