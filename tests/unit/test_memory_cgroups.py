"""Issue 45 scenario B (the cgroup side): where the control server puts each agent's memory cgroup and
what it writes there, on a fake cgroupfs directory tree for cgroup v2 (Debian 12's default, which this
hybrid build host cannot run: the v2 code path is tested here only) and cgroup v1; why agents are
unbounded when no cgroup can be made; the values of ``agents.max_memory``.

The v1 path also runs for real, as root, in tests/integration/test_agent_memory.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from daemon.agentctl.sandbox import memory_cgroups as mc
from daemon.agents import memory
from daemon.agents.settings import SettingsError, parse_agent_table
from daemon.config.keys import ConfigError
from daemon.config.settings import agent_memory_bound, load_config, validate_agents

PID = 4242
ID = "0123456789abcdef0123456789abcdef"
UNIT = "/system.slice/kandev-agentctl.service"


def v2_tree(root: Path, *, controllers: str = "memory pids", procs: str = f"{PID}\n") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    own = root / UNIT.lstrip("/")
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text(controllers + "\n")
    (own / "cgroup.subtree_control").write_text("")
    (own / "cgroup.procs").write_text(procs)
    return own


def v1_tree(root: Path, own: str = "/process_api/x") -> Path:
    (root / "unified").mkdir(parents=True)  # hybrid: v2 without controllers, memory on v1
    mem = root / "memory"
    (mem / own.lstrip("/")).mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    return mem / own.lstrip("/")


def test_v2_the_server_moves_into_its_leaf_and_gives_its_cgroup_the_memory_controller(tmp_path: Path) -> None:
    """Issue 45 scenario B (cgroup v2): the server's delegated cgroup gets ``+memory`` in its
    subtree_control after the server moved itself into the ``agentctl`` leaf; an agent's cgroup is
    ``agent-<instance id>`` beside it with memory.max and memory.oom.group = 1."""
    own = v2_tree(tmp_path)
    host = mc.probe(str(tmp_path), f"0::{UNIT}\n", PID)
    assert host == mc.MemoryHost("v2", str(own), UNIT, None) and host.bounded
    assert (own / "agentctl" / "cgroup.procs").read_text() == str(PID)
    assert (own / "cgroup.subtree_control").read_text() == "+memory"
    cg = mc.create(host, ID, 256 * memory.MiB)
    assert cg.path == str(own / f"agent-{ID}")
    assert (own / f"agent-{ID}" / "memory.max").read_text() == str(256 * memory.MiB)
    assert (own / f"agent-{ID}" / "memory.oom.group").read_text() == "1"
    assert mc.oom_eventfd(cg) is None  # v2 needs no notification: the kernel ends the whole group
    assert mc.oom_kills(cg) == 0
    (own / f"agent-{ID}" / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\noom_group_kill 1\n")
    assert mc.oom_kills(cg) == 1
    assert mc.leftovers(host) == [cg.path]


def test_v2_after_a_re_exec_the_leaf_says_the_set_up_is_done(tmp_path: Path) -> None:
    """Issue 45 scenario B (reloads, v2): a new image of the server, already in ``<cgroup>/agentctl``,
    finds the same place for agents' cgroups and moves nothing."""
    own = v2_tree(tmp_path, procs="")
    (own / "agentctl").mkdir()
    (own / "cgroup.subtree_control").write_text("memory\n")  # as the kernel shows it
    host = mc.probe(str(tmp_path), f"0::{UNIT}/agentctl\n", PID)
    assert host.base == str(own) and host.reason is None
    assert not (own / "agentctl" / "cgroup.procs").exists()


def test_v2_a_child_of_the_backend_settles_beside_the_backends_leaf(tmp_path: Path) -> None:
    """Issue 45 scenario B (survival off, cgroup v2): the backend, alone in its delegated cgroup, moves
    into ``backend`` and gives the cgroup the memory controller; its child control server, in that leaf
    with the backend, settles in ``agentctl`` beside it and makes its agents' cgroups there."""
    unit = "/system.slice/kandev-backend.service"
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    own = tmp_path / unit.lstrip("/")
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("memory pids\n")
    (own / "cgroup.procs").write_text(f"{PID}\n")
    (own / "cgroup.subtree_control").write_text("")
    assert mc.make_room(str(tmp_path), f"0::{unit}\n", PID) is None
    assert (own / "backend" / "cgroup.procs").read_text() == str(PID)
    assert (own / "cgroup.subtree_control").read_text() == "+memory"
    (own / "cgroup.subtree_control").write_text("memory\n")  # as the kernel shows it
    (own / "backend" / "cgroup.procs").write_text(f"{PID}\n{PID + 1}\n")
    assert mc.make_room(str(tmp_path), f"0::{unit}/backend\n", PID) is None  # done already
    host = mc.probe(str(tmp_path), f"0::{unit}/backend\n", PID + 1)
    assert host.base == str(own / "agentctl") and host.reason is None, host
    assert (own / "agentctl" / "agentctl" / "cgroup.procs").read_text() == str(PID + 1)
    assert (own / "agentctl" / "cgroup.subtree_control").read_text() == "+memory"
    assert mc.agent_path(host, ID) == str(own / "agentctl" / f"agent-{ID}")
    shared = tmp_path / "shared"
    v2_tree(shared, procs=f"{PID}\n17\n")
    assert "holds other processes" in (mc.make_room(str(shared), f"0::{UNIT}\n", PID) or "")
    assert mc.make_room(str(tmp_path / "v1-host"), "4:memory:/\n0::/\n", PID) == "not cgroup v2"


@pytest.mark.parametrize(("controllers", "procs", "why"), [
    ("pids", f"{PID}\n", "memory controller is not available"),
    ("memory pids", f"{PID}\n17\n", "holds other processes too"),
])
def test_v2_without_delegation_agents_are_unbounded_and_told_why(tmp_path: Path, controllers: str, procs: str,
                                                                  why: str) -> None:
    """Issue 45 scenario B: no memory controller in the server's cgroup (no Delegate=yes), or a cgroup
    it shares with other processes: nothing is made, and the reason names the cgroup."""
    own = v2_tree(tmp_path, controllers=controllers, procs=procs)
    host = mc.probe(str(tmp_path), f"0::{UNIT}\n", PID)
    assert not host.bounded and host.hierarchy == "v2"
    assert why in (host.reason or "") and UNIT in (host.reason or "")
    assert sorted(p.name for p in own.iterdir()) == ["cgroup.controllers", "cgroup.procs", "cgroup.subtree_control"]


def test_v1_agents_cgroups_go_below_the_servers_memory_cgroup(tmp_path: Path) -> None:
    """Issue 45 scenario B (cgroup v1, hybrid): the server's memory cgroup is the base (a trial cgroup
    made and removed); an agent's gets memory.limit_in_bytes; the OOM-kill counter is read from
    memory.oom_control."""
    own = v1_tree(tmp_path)
    host = mc.probe(str(tmp_path), "9:name=systemd:/\n4:memory:/process_api/x\n0::/\n", PID)
    assert host == mc.MemoryHost("v1", str(own), "/process_api/x", None)
    assert list(own.iterdir()) == []  # the trial cgroup is gone
    cg = mc.create(host, ID, 64 * memory.MiB)
    assert (own / f"agent-{ID}" / "memory.limit_in_bytes").read_text() == str(64 * memory.MiB)
    (own / f"agent-{ID}" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert mc.oom_kills(cg) == 2


def test_no_memory_controller_and_hostile_paths_leave_agents_unbounded(tmp_path: Path) -> None:
    """Issue 45 scenario B: no controller at all, or a cgroup path that would leave the hierarchy:
    unbounded with the reason; an id this server never generates names no cgroup."""
    host = mc.probe(str(tmp_path), "0::/\n", PID)
    assert not host.bounded and "no memory cgroup controller" in (host.reason or "")
    v1_tree(tmp_path / "h")
    host = mc.probe(str(tmp_path / "h"), "4:memory:/../../etc\n", PID)
    assert not host.bounded and "is not below" in (host.reason or "")
    good = mc.probe(str(tmp_path / "h"), "4:memory:/process_api/x\n", PID)
    for bad in ("../../etc", "x" * 32, ID + "/..", ""):
        with pytest.raises(ValueError):
            mc.agent_path(good, bad)


def test_kill_all_ends_every_member_by_pidfd(tmp_path: Path) -> None:
    """Issue 45 scenario B (v1 has no oom.group): every process listed in the cgroup is ended."""
    own = v1_tree(tmp_path)
    host = mc.probe(str(tmp_path), "4:memory:/process_api/x\n", PID)
    cg = mc.create(host, ID, 64 * memory.MiB)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (own / f"agent-{ID}" / "cgroup.procs").write_text(f"{sleeper.pid}\n")
        assert mc.kill_all(cg) == 1
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    os.remove(own / f"agent-{ID}" / "cgroup.procs")
    for name in os.listdir(cg.path):
        os.remove(os.path.join(cg.path, name))
    assert mc.remove(cg) and not os.path.exists(cg.path)


def test_host_controller_says_where_memory_is(tmp_path: Path) -> None:
    """Issue 45 scenario B (doctor before a control server answers): where the controller is."""
    assert mc.host_controller(str(tmp_path))[0] is None
    v1_tree(tmp_path / "v1")
    assert mc.host_controller(str(tmp_path / "v1"))[0] == "v1"
    v2_tree(tmp_path / "v2")
    hierarchy, detail = mc.host_controller(str(tmp_path / "v2"))
    assert hierarchy == "v2" and "Delegate=yes" in detail


def test_sizes_are_bytes_or_a_number_with_a_binary_unit() -> None:
    """Issue 45 scenario B: ``agents.max_memory`` is bytes or ``8G``-style."""
    assert memory.parse_bytes("8G") == 8 * memory.GiB
    assert memory.parse_bytes("512M") == memory.parse_bytes("512MiB") == memory.parse_bytes("512mb") == 512 * memory.MiB
    assert memory.parse_bytes("1.5G") == 1536 * memory.MiB
    assert memory.parse_bytes(268435456) == memory.parse_bytes("268435456") == 256 * memory.MiB
    for bad in ("8X", "-1G", "", "1.5", True, 1.5, "G"):
        with pytest.raises(ValueError):
            memory.parse_bytes(bad)
    assert memory.format_bytes(8 * memory.GiB) == "8G" and memory.format_bytes(1536 * memory.MiB) == "1536M"
    assert memory.human_bytes(192 * memory.MiB) == "192 MiB"


def test_out_of_range_bounds_are_refused_naming_key_value_and_range(tmp_path: Path) -> None:
    """Issue 45 scenario B: below 64 MiB or above the host's RAM, ``agents.max_memory`` and
    ``[agents.NAME] max_memory`` are refused naming the key, the value and the range; unset, an
    agent's bound is half the host's RAM, and a per-agent bound wins."""
    config = tmp_path / "kandev.toml"
    too_big = memory.format_bytes(memory.host_memory() + memory.GiB)
    for value, problem in (('"10M"', "out of range"), (f'"{too_big}"', "out of range"), ('"lots"', "not a size")):
        config.write_text(f"[agents]\nmax_memory = {value}\n")
        with pytest.raises(ConfigError) as err:
            validate_agents(load_config(str(config), env={}))
        text = str(err.value)
        assert err.value.key == "agents.max_memory" and value in text and problem in text, text
        if problem == "out of range":
            assert "64M.." in text, text
    with pytest.raises(SettingsError) as bad:
        parse_agent_table("mock", {"max_memory": "32M"})
    assert bad.value.key == "agents.mock.max_memory" and "'32M'" in str(bad.value) and "64M.." in str(bad.value)
    config.write_text('[agents]\nmax_memory = "1G"\n[agents.mock]\nmax_memory = "256M"\n')
    loaded = load_config(str(config), env={})
    validate_agents(loaded)
    assert agent_memory_bound(loaded, "mock") == 256 * memory.MiB
    assert agent_memory_bound(loaded, "codex") == memory.GiB
    config.write_text("")
    assert agent_memory_bound(load_config(str(config), env={}), "mock") == memory.host_memory() // 2
    env = {"KANDEV_AGENTS_MAX_MEMORY": "2G"}
    assert load_config(str(config), env=env).agents.max_memory == 2 * memory.GiB
