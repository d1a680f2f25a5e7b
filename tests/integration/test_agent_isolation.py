"""No agent is host root, and one agent cannot starve its neighbours (Issue 19 D and E, Issue 21 A to
D): the real daemons, as root (the agents then run as ``kandev-agent``), attacked from inside with
the mock agent's ``/sh``."""

from __future__ import annotations

import os
import pwd
import signal
import stat
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.kandev import Kandev
from tests.support.paths import REPO_ROOT
from tests.support.sessions import restart
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(300)
MiB = 1024 * 1024


def sh(k: Kandev, sid: str, script: str) -> str:
    """What the mock agent's ``/sh script`` printed (its exit status first)."""
    k.cli("prompt", sid, "/sh " + script, "--wait", timeout=180)
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


def sh_said(k: Kandev, sid: str, prompt: str) -> str:
    k.cli("prompt", sid, prompt, "--wait", timeout=180)
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


def two_sessions(k: Kandev, root: Path) -> tuple[str, str]:
    sids = []
    for name in ("a", "b"):
        ws = root / f"ws-{name}"
        ws.mkdir()
        task = k.cli("task", "create", "--title", name, "--workspace", str(for_agent(ws)))["task_id"]
        sids.append(k.cli("session", "start", task)["session_id"])
        k.show(sids[-1])
    return sids[0], sids[1]


def agent_processes(leader: int) -> list[psutil.Process]:
    """The sandbox's processes: bwrap (the group leader) and everything below it."""
    p = psutil.Process(leader)
    return [p, *p.children(recursive=True)]


def test_issue_19_scenario_d_and_issue_21_scenario_d_the_agent_is_no_host_root_and_has_its_own_ipc(
        kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 19 scenario D: with kandev running as root, every line of the agent's
    /proc/self/uid_map maps to a non-zero host uid (kandev-agent's), writing under /proc/sys fails,
    and the agent still writes its workspace and runs git, python3 and node. Issue 21 scenario D: a
    SysV shared-memory segment made in one sandbox is not visible in another. Issue 19 E (part):
    the agent's PATH holds the system directories only."""
    k = kandev_factory()
    k.up()
    a, b = two_sessions(k, short_tmp)
    said = sh(k, a, "cat /proc/self/uid_map; echo uid=$(id -u); "
                    "for f in /proc/sys/kernel/core_pattern /proc/sys/kernel/hostname /proc/sys/vm/drop_caches; do"
                    " (echo x > $f) 2>/dev/null && echo WROTE $f; done; "
                    "echo hi > probe.txt && cat probe.txt; git init -q g && git -C g status --porcelain && echo GIT_OK; "
                    "python3 -c 'print(\"PY_OK\")'; node -e 'console.log(\"NODE_OK\")'; echo PATH=$PATH; "
                    "ipcmk -M 4096")
    assert said.startswith("sh: exit=0\n"), said
    lines = said.splitlines()
    maps = [line.split() for line in lines if len(line.split()) == 3 and all(f.isdigit() for f in line.split())]
    agent = pwd.getpwnam("kandev-agent").pw_uid if os.geteuid() == 0 else os.geteuid()
    assert maps and all(int(host) != 0 for _inside, host, _n in maps), said
    assert f"uid={agent}" in lines and [str(agent), str(agent), "1"] in maps, said
    assert not any(line.startswith("WROTE") for line in lines), said
    for ok in ("hi", "GIT_OK", "PY_OK", "NODE_OK"):
        assert ok in lines, said
    path = next(line for line in lines if line.startswith("PATH="))[5:].split(":")
    assert all(p.startswith(("/usr/", "/bin", "/sbin")) for p in path), path
    assert any(line.startswith("Shared memory id:") for line in lines), said
    other = sh(k, b, "ipcs -m | grep -c '^0x' || true")
    assert other.splitlines()[1:] == ["0"], other  # nothing of A's segment in B


def test_a_workspace_the_agent_uid_cannot_write_is_refused_with_the_fix(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 19 item 4: a user-given workspace the agents' uid cannot write is refused at task create,
    naming the uid and the fix, and nothing of it changes owner or mode."""
    if os.geteuid() != 0:
        pytest.skip("agents keep our own uid when kandev is not root")
    k = kandev_factory()
    k.up()
    ws = short_tmp / "mine"
    ws.mkdir(mode=0o755)
    before = os.stat(ws)
    proc = k.run("task", "create", "--title", "x", "--workspace", str(ws))
    assert proc.returncode == 1 and '"workspace_not_writable"' in proc.stdout, proc
    uid = pwd.getpwnam("kandev-agent").pw_uid
    assert f"uid {uid}" in proc.stdout and "chown -R kandev-agent" in proc.stdout, proc.stdout
    after = os.stat(ws)
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)


def _log_bytes(directory: Path) -> int:
    total = 0
    for entry in os.scandir(directory):
        try:
            total += entry.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def test_issue_19_scenario_e_and_issue_21_scenario_c_stderr_is_a_bounded_pipe(kandev_factory: Any,
                                                                              short_tmp: Path) -> None:
    """Issue 19 scenario E: the agent cannot write its stderr log by path (its stderr is a pipe to
    the control server; the log file is nowhere in its view). Issue 21 scenario C (and 19 E's 100 MB):
    200 MB written to the agent's stderr never grows the agents' logs on disk by more than 32 MiB at
    any sampled moment, and a sibling session answers meanwhile."""
    k = kandev_factory()
    k.up()
    a, b = two_sessions(k, short_tmp)
    log = k.home / "logs" / "agents" / f"{k.show(a)['instance_id']}.stderr.log"
    said = sh(k, a, f"readlink /proc/$PPID/fd/2; (echo PLANTED''BY''PATH >> {log}) 2>/dev/null && echo WROTE_LOG;"
                    " (echo PLANTED''BY''PATH > /proc/$PPID/fd/2) 2>/dev/null && echo REOPENED_STDERR;"
                    " ls /proc/1/fd >/dev/null 2>&1 && echo SAW_INIT_FDS; echo namespaces=$(ls -l /proc/$PPID/fd | grep -c user:)")
    assert said.splitlines()[1].startswith("pipe:["), said
    assert "WROTE_LOG" not in said and "REOPENED_STDERR" not in said and "SAW_INIT_FDS" not in said, said
    assert "namespaces=0" in said.splitlines(), said  # no descriptor of the namespaces kandev made for it
    assert "stderr: wrote 4096" in sh_said(k, a, "/stderr 4096")
    wait_until(lambda: log.exists() and b"x" * 100 in log.read_bytes(), timeout=30)
    assert b"PLANTEDBYPATH" not in log.read_bytes()

    directory = log.parent
    baseline = _log_bytes(directory)
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_log_bytes(directory) - baseline)
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        flood = k.popen("prompt", a, "/stderr 200000000", "--wait")
        assert sh(k, b, "echo sibling-answers").splitlines()[1] == "sibling-answers"
        assert flood.wait(timeout=180) == 0
    finally:
        done.set()
        sampler.join()
    said = [m["text"] for m in k.show(a)["transcript"] if m["kind"] == "agent_message_chunk"][-1]
    assert said == "stderr: wrote 200000000", said
    wait_until(lambda: log.read_bytes().endswith(b"x"), timeout=30)
    assert len(samples) > 10 and max(samples) <= 32 * MiB, (len(samples), max(samples))
    assert log.stat().st_size <= 11 * MiB and log.read_bytes().startswith(b"[kandev: ")


def test_issue_19_scenario_e_the_home_tidy_up_never_follows_a_planted_symlink(kandev_factory: Any,
                                                                              short_tmp: Path) -> None:
    """Issue 19 scenario E: directories under the agent's HOME and workspace replaced by symlinks to
    files and directories outside (planted by the agent and by the test), survival on, then the
    backend restarted so the home tidy-up runs: no file outside changes mode or owner."""
    outside = short_tmp / "outside"
    outside.mkdir()
    victims = [outside / "file", outside / "dir", outside / "dir" / "inner"]
    victims[0].write_text("x")
    victims[1].mkdir(mode=0o755)
    victims[2].write_text("y")
    for v in victims:
        v.chmod(0o755 if v.is_dir() else 0o644)
    before = {v: (os.lstat(v).st_mode, os.lstat(v).st_uid) for v in victims}
    k = kandev_factory("home", "[features]\nagent_survival = true\n")
    k.up()
    a, _b = two_sessions(k, short_tmp)
    said = sh(k, a, f"mkdir -p $HOME/sub ws-sub && rm -rf $HOME/sub ws-sub && ln -s {victims[1]} $HOME/sub"
                    f" && ln -s {victims[0]} $HOME/file && ln -s {victims[1]} ws-sub && echo planted")
    assert "planted" in said, said
    home = k.home / "sessions" / a / "agent" / "home"
    (home / "bydir").symlink_to(victims[1])  # and one planted by the test, as a race would leave it
    (k.home / "sessions" / a / "agent" / "late").symlink_to(victims[0])
    restart(k)
    wait_until(lambda: "home_tidied" in (k.home / "logs" / "backend.log").read_text()
               or k.status()["backend"]["state"] == "ready", timeout=30)
    for v in victims:
        st = os.lstat(v)
        assert (st.st_mode, st.st_uid) == before[v], v


def test_issue_21_scenario_a_a_fork_bomb_fails_inside_its_own_agent(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 21 scenario A: with agents.max_processes = 200, an agent forking 600 sleeping processes
    gets fork failures past 200 (the kernel's RLIMIT_NPROC in that agent's own user namespace);
    a sibling session of the same uid starts processes and answers, and kandev status answers."""
    k = kandev_factory("home", "[agents]\nmax_processes = 200\n")
    k.up()
    a, b = two_sessions(k, short_tmp)
    bomb = ("python3 -c \"import os, time\nn = failed = 0\nfor _ in range(600):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        failed += 1\n        continue\n    if pid == 0:\n"
            "        os.closerange(0, 3); time.sleep(45); os._exit(0)\n    n += 1\nprint('forked', n, 'failed', failed)\"")
    said = sh(k, a, bomb)
    forked, failed = (int(w) for w in said.split()[3::2])
    assert said.startswith("sh: exit=0\nforked"), said
    assert 100 < forked < 200 and failed == 600 - forked, said
    assert sh(k, b, "sh -c 'echo neighbour-forks'").splitlines()[1] == "neighbour-forks"
    assert k.status()["backend"]["state"] == "ready"
    leader = int(k.show(a)["agent_pid"])
    assert 150 < len(agent_processes(leader)) <= 200 + 3  # bwrap (outside its namespace) + its init


def test_issue_21_scenario_b_an_oom_killed_agent_is_reported_and_stops_nothing_else(kandev_factory: Any,
                                                                                   short_tmp: Path) -> None:
    """Issue 21 scenario B: every process of an agent has an oom_score_adj at least 300 above each
    daemon's; the control server's unit sets OOMPolicy=continue; SIGKILL to the agent's process (as
    the OOM killer would send) ends its session like an agent loss, said truthfully (the session's
    error and the journal's agent_killed name SIGKILL), and the sibling session keeps working."""
    unit = (REPO_ROOT / "units" / "kandev-agentctl.service").read_text()
    assert "OOMPolicy=continue" in unit.splitlines()
    k = kandev_factory()
    k.up()
    a, b = two_sessions(k, short_tmp)
    status = k.status()
    daemons = [int(status["backend"]["pid"]), int(status["control_server"]["pid"])]
    leader = int(k.show(a)["agent_pid"])
    procs = agent_processes(leader)
    worst_daemon = max(int(Path(f"/proc/{pid}/oom_score_adj").read_text()) for pid in daemons)
    for p in procs:
        assert int(Path(f"/proc/{p.pid}/oom_score_adj").read_text()) >= worst_daemon + 300, p
    agent = next(p for p in procs if "daemon.agents.mock" in " ".join(p.cmdline()))
    os.kill(agent.pid, signal.SIGKILL)
    wait_until(lambda: k.show(a)["state"] == "FAILED", timeout=60)
    assert "SIGKILL" in (k.show(a).get("last_error") or ""), k.show(a)
    wait_until(lambda: "agent_killed" in (k.home / "logs" / "agentctl.log").read_text(), timeout=30)
    text = (k.home / "logs" / "agentctl.log").read_text()
    assert "killed by SIGKILL" in text
    assert sh(k, b, "echo still-here").splitlines()[1] == "still-here"
    for pid in daemons:
        assert psutil.pid_exists(pid)
    assert stat.S_ISDIR(os.stat(k.home).st_mode)
