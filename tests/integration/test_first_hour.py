"""Issue 23: a new user's first hour, through the real CLI (stdout, stderr, exit status) against
real daemons (Issue 23 scenario A: each test names the shortcoming of the issue's "Why" it proves
fixed, and each fails on the behaviour before the fix; Issue 23 scenario B: the concrete checks).

Most share one backend (survival off, module scope) to keep the suite lean; the ones that stop
and start backends have their own home.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev, make_env
from tests.support.paths import REPO_ROOT
from tests.support.processes import group_exists
from tests.support.streams import TimedOutput
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def k() -> Iterator[Kandev]:
    """One backend, survival off."""
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d:
        os.chmod(d, 0o700)
        config = Path(d) / "kandev.toml"
        config.write_text("")
        kandev = Kandev(Path(d) / "home", make_env(config))
        try:
            kandev.up()
            yield kandev
        finally:
            kandev.cleanup()


def _cli(env: dict[str, str], *args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.cli", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=REPO_ROOT, timeout=120)


def _waiting(k: Kandev, sid: str) -> dict[str, Any]:
    return wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)


def _session(k: Kandev, title: str, *extra: str) -> tuple[str, str]:
    task, sid = k.start_session(title, *extra)
    _waiting(k, sid)
    return task, sid


def _board(k: Kandev) -> dict[str, Any]:
    return k.cli("board")


def _attention(k: Kandev, task: str) -> dict[str, Any] | None:
    """Why the task needs its user (task list --json), None when it does not."""
    return next(t for t in k.cli("task", "list")["tasks"] if t["task_id"] == task)["attention"]


# -- item 6: conventions ---------------------------------------------------------------------


def test_version_on_all_three_executables() -> None:
    """Issue 23 item 4 (Why 6: no --version anywhere)."""
    from daemon.core.version import VERSION

    for module, name in (("daemon.cli", "kandev"), ("daemon.backend.main", "kandev-backend"),
                         ("daemon.agentctl.main", "kandev-agentctl")):
        p = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                           cwd=REPO_ROOT, timeout=60)
        assert (p.returncode, p.stdout.strip(), p.stderr) == (0, f"{name} {VERSION}", ""), (module, p)


def test_global_flags_after_the_command_and_did_you_mean(k: Kandev) -> None:
    """Issue 23 scenario B (Why 6): `status --json`, `--home` after the command, "did you mean"."""
    env = k.env
    p = _cli(env, "status", "--json", "--home", str(k.home))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["backend"]["home"] == str(k.home)
    p = _cli(env, "--home", str(k.home), "task", "list", "--json")
    assert p.returncode == 0 and "tasks" in json.loads(p.stdout)
    p = _cli(env, "--home", str(k.home), "sesion", "list")
    assert p.returncode == 2 and p.stdout == ""
    assert "unknown command 'sesion'; did you mean 'session'?" in p.stderr
    p = _cli(env, "--home", str(k.home), "session", "lst")
    assert p.returncode == 2 and "did you mean 'list'?" in p.stderr


def test_down_of_a_never_started_home_exits_0_with_a_note(short_tmp: Path) -> None:
    """Issue 23 scenario B (Why 6: `kandev down` exited 3 when nothing ran)."""
    config = short_tmp / "kandev.toml"
    config.write_text("")
    env = make_env(config)
    home = short_tmp / "never"
    p = _cli(env, "--home", str(home), "down")
    assert (p.returncode, p.stderr) == (0, ""), p
    assert p.stdout.strip() == f"No backend is running for {home}: nothing to stop."
    p = _cli(env, "--home", str(home), "--json", "down")
    assert p.returncode == 0 and json.loads(p.stdout) == {"home": str(home), "running": False, "stopped": False}


@pytest.mark.parametrize("command", [("board",), ("status",), ("session", "list", "--all"), ("task", "list")])
def test_a_closed_pipe_ends_the_command_quietly(k: Kandev, command: tuple[str, ...]) -> None:
    """Issue 23 scenario B (Why 5: `kandev status | head -3` printed a BrokenPipeError traceback).
    The reader is gone before kandev writes: every write fails with EPIPE."""
    if command[0] in ("board", "task"):
        k.cli("task", "create", "--title", "something for the board")
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(k.home), *command], stdout=write,
                           stderr=subprocess.PIPE, text=True, env=k.env, cwd=REPO_ROOT, timeout=60)
    finally:
        os.close(write)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


# -- item 1: an honest up ---------------------------------------------------------------------


def test_up_names_only_this_starts_bad_key_and_refuses_another_config(kandev_factory, short_tmp: Path) -> None:
    """Issue 23 scenario B, Issue 23 item 1 (Why 1): a bad `up --config` after an earlier bad start
    names only this start's key (file, value, range) and starts nothing; doctor's hint names the
    file in use; `up --config OTHER` against a running backend says so, exit 1."""
    k = kandev_factory("up")
    first, second = short_tmp / "first.toml", short_tmp / "second.toml"
    first.write_text('[agentctl]\nrecovery_deadline = "10min"\n')
    second.write_text("[agentctl]\nrecovery_read_retries = 99\n")
    p1 = k.human("up", "--config", str(first))
    assert p1.returncode == 1 and p1.stdout == ""
    assert "agentctl.recovery_deadline" in p1.stderr and str(first) in p1.stderr
    assert '"10min"' in p1.stderr and "1s..5min" in p1.stderr
    p2 = k.human("up", "--config", str(second))
    assert p2.returncode == 1 and p2.stdout == ""
    assert "agentctl.recovery_read_retries" in p2.stderr and str(second) in p2.stderr and "99" in p2.stderr
    assert "0..10" in p2.stderr
    assert "recovery_deadline" not in p2.stderr and str(first) not in p2.stderr  # only this start's error
    assert "|" not in p2.stderr and "Traceback" not in p2.stderr
    assert not (k.home / "run" / "backend.sock").exists()  # nothing was started
    doctor = k.run("doctor", "--config", str(second))
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "config")
    assert doctor.returncode == 1 and str(second) in check["hint"] and "/etc/kandev/kandev.toml" not in check[
        "hint"].split(";")[0]

    good = short_tmp / "good.toml"
    good.write_text("")
    k.cli("up", "--config", str(good))
    assert k.cli("status")["backend"]["config"] == str(good)
    other = short_tmp / "other.toml"
    other.write_text("[features]\nauto_resume = true\n")
    p = k.human("up", "--config", str(other))
    assert p.returncode == 1 and p.stdout == ""
    assert f"with {good}; --config {other} was not applied" in p.stderr and "kandev down" in p.stderr
    assert k.human("up", "--config", str(good)).returncode == 0  # the same file: already running, fine


# -- item 2: verbs to finish things -----------------------------------------------------------


def test_cancel_with_no_running_turn_exits_1_and_says_so(k: Kandev) -> None:
    """Issue 23 scenario B (Why 3: `cancel` said the cancel was sent, exit 0)."""
    _, sid = _session(k, "nothing to cancel")
    p = k.human("cancel", sid)
    assert p.returncode == 1 and p.stdout == ""
    assert "has no running turn to cancel (it is WAITING_FOR_INPUT)" in p.stderr


def test_session_stop_ends_the_agents_group_and_keeps_the_session(k: Kandev) -> None:
    """Issue 23 scenario B, Issue 23 item 2 (Why 2: no `session stop`): the agent's process group is
    gone, the session is readable and says it has no agent; the board says `no agent`; resume
    gives it one again."""
    task, sid = _session(k, "stop me", "--prompt", "remember this")
    pgid = int(k.show(sid)["agent_pid"])
    assert group_exists(pgid)
    p = k.human("session", "stop", sid[:8])
    assert p.returncode == 0 and p.stderr == ""
    assert len(p.stdout.splitlines()) == 1 and p.stdout.startswith(f"Stopped the agent of session {sid[:8]}")
    wait_until(lambda: not group_exists(pgid), timeout=30, message="the agent's process group is gone")
    show = k.show(sid)
    assert show["state"] == "WAITING_FOR_INPUT" and not show["live"]
    assert any("remember this" in (e.get("text") or "") for e in show["transcript"])
    assert task in _board(k)["needs_attention"]
    assert _attention(k, task) == {"reason": "no agent", "hint": None}
    again = k.human("session", "stop", sid)
    assert again.returncode == 1 and "has no agent to stop" in again.stderr
    assert f"kandev resume {sid}" in again.stderr
    k.cli("resume", sid, timeout=180)
    assert task not in _board(k)["needs_attention"]


def test_task_done_and_reopen_move_the_task_on_the_board(k: Kandev) -> None:
    """Issue 23 scenario B (Why 2: nothing marked a task done)."""
    task, sid = _session(k, "finish me")
    p = k.human("task", "done", task[:8])
    assert (p.returncode, p.stderr) == (0, "") and len(p.stdout.splitlines()) == 1
    assert p.stdout.startswith(f"Task {task[:8]} is done")
    assert task in _board(k)["done"]
    human = k.human("board").stdout
    assert re.search(rf"DONE \(\d+\)\n(  .*\n)*  {task[:8]}  finish me", human), human
    p = k.human("task", "reopen", task)
    assert p.returncode == 0 and "TURN FINISHED" in p.stdout
    assert task in _board(k)["turn_finished"]
    assert k.human("task", "reopen", task).returncode == 1  # not done: refused, says so


# -- item 3: the board shows what needs you ---------------------------------------------------


def test_a_permission_request_and_a_failed_turn_need_attention_with_their_reason(k: Kandev) -> None:
    """Issue 23 scenario B (Why 4): a session waiting on a permission request (it showed under
    RUNNING) and a `/fail` turn (it sat in TURN FINISHED) are in NEEDS ATTENTION with the reason."""
    asking, sid_p = _session(k, "asks permission")
    failing, sid_f = _session(k, "fails")
    k.cli("prompt", sid_p, "/permission")
    k.cli("prompt", sid_f, "/fail", "--wait")
    board = wait_until(lambda: b if asking in (b := _board(k))["needs_attention"] else None, timeout=30)
    assert failing in board["needs_attention"]
    assert _attention(k, asking) == {"reason": "permission", "hint": None}
    assert _attention(k, failing) == {"reason": "failed", "hint": None}
    human = k.human("board")
    assert human.returncode == 0 and human.stdout.startswith("NEEDS ATTENTION (")
    section = human.stdout.split("BACKLOG (")[0]
    assert re.search(rf"permission\s+{asking[:8]}\s+asks permission", section), section
    assert re.search(rf"failed\s+{failing[:8]}\s+fails\s+.*mock /fail", section), section
    request = k.show(sid_p)["permissions"][0]["request_id"]
    k.cli("permission", sid_p, request, "--option", "allow")
    _waiting(k, sid_p)
    assert asking not in _board(k)["needs_attention"]


def test_logs_show_the_agents_stderr_and_follow_it(k: Kandev) -> None:
    """Issue 23 scenario B (Why 7: no `kandev logs`): the mock's stderr line for its last prompt."""
    _, sid = _session(k, "logs")
    k.cli("prompt", sid, "first marker", "--wait")
    p = k.human("logs", sid[:8], "--tail", "1")
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    assert len(p.stdout.splitlines()) == 1 and "session/prompt" in p.stdout and "text='first marker'" in p.stdout
    assert "kandev-mock[" in k.human("logs", sid).stdout  # the start lines too (default: the last 50)
    follow = k.popen("logs", sid, "-f")
    out = TimedOutput(follow.stdout)
    out.wait_for("first marker", timeout=30)
    k.cli("prompt", sid, "second marker", "--wait")
    out.wait_for("second marker", timeout=30)  # written after -f started: followed
    follow.terminate()
    follow.wait(timeout=10)


def test_a_waiting_logs_read_answers_when_the_agent_writes(k: Kandev) -> None:
    """Issue 47 item 3 (``logs`` on any host; ``-f`` asks once per change, not every half second:
    on another host each ask is a request row): ``session_logs`` with ``offset`` and ``wait_s``
    answers once the agent wrote, with what it wrote; with nothing written, empty after
    ``wait_s``; out of range is refused."""
    import threading

    from daemon.cli.call import call

    def logs(**args: Any) -> dict[str, Any]:
        answer: dict[str, Any] = call(k.home / "run" / "backend.sock", "session_logs", {"session_id": sid, **args})
        return answer

    _, sid = _session(k, "waiting logs")
    end = k.cli("logs", sid)["offset"]
    quiet = logs(offset=end, wait_s=1)
    assert (quiet["text"], quiet["offset"]) == ("", end), quiet
    answer: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: answer.append(logs(offset=end, wait_s=30)))
    waiter.start()
    k.cli("prompt", sid, "third marker", "--wait")
    waiter.join(timeout=60)
    assert answer and "third marker" in answer[0]["text"] and answer[0]["offset"] > end, answer
    with pytest.raises(Exception, match="wait_s 31 is not in 0..30"):
        logs(offset=end, wait_s=31)


# -- item 3: a clean down is information; warnings clear once resumed ----------------------------


def test_a_clean_down_is_information_and_a_lost_agent_warning_clears_once_resumed(kandev_factory) -> None:
    """Issue 23 item 3 (Why 9): after `kandev down` with survival off the next start warns of
    nothing (it reports the stopped agents as information); after a backend SIGKILL the warning
    names the session until it is resumed."""
    k = kandev_factory("clean", KANDEV_FEATURES_AUTO_RESUME="false")  # resumed by hand, not automatically
    k.up()
    _, sid = _session(k, "clean stop")
    down = k.human("down")
    assert down.returncode == 0 and "its 1 agent was stopped" in down.stdout
    st = k.up()
    assert st["recovery"]["not_retracked"] == 0 and st["recovery"]["stopped_with_backend"] == 1
    status = k.human("status").stdout
    assert "Warning" not in status and "1 session had its agent stopped with the previous backend" in status
    assert k.show(sid)["interruption"]["cause"] == "backend_stopped"

    k.cli("resume", sid, timeout=180)
    backend = k.backend_pid
    os.kill(backend, 9)
    wait_until(lambda: not Path(f"/proc/{backend}").exists(), timeout=30)
    st = k.up()
    assert st["recovery"]["not_retracked"] == 1 and st["recovery"]["without_agent"] == 1
    assert "1 session could not be re-tracked" in k.human("status").stdout
    k.cli("resume", sid, timeout=180)
    st = k.status()
    assert st["recovery"]["without_agent"] == 0
    assert "Warning" not in k.human("status").stdout


def test_down_agents_stops_a_detached_control_server_and_its_agents(kandev_factory) -> None:
    """Issue 23 item 2 (Why 2: with survival on and no systemd, `kandev down` left the detached
    control server and its agents running and nothing in the CLI stopped them)."""
    k = kandev_factory("agents", "[features]\nagent_survival = true\n")
    k.up()
    _, sid = _session(k, "detached")
    show = k.show(sid)
    pgid, server = int(show["agent_pid"]), int(k.status()["control_server"]["pid"])
    assert k.human("down").returncode == 0
    assert group_exists(pgid) and Path(f"/proc/{server}").exists()  # survival: both outlive the backend
    p = k.human("down", "--agents")
    assert p.returncode == 0, p.stderr
    assert "no backend runs, but a detached control server does" in p.stderr
    assert "its control server and its 1 agent" in p.stderr
    assert p.stdout.strip().endswith("its 1 agent was stopped.")
    wait_until(lambda: not group_exists(pgid) and not Path(f"/proc/{server}").exists(), timeout=30)
    st = k.up()  # nothing left to re-track, nothing lost: the session waits for input
    assert st["recovery"]["not_retracked"] == 0
    assert k.show(sid)["state"] == "WAITING_FOR_INPUT"


# -- Issue 23 scenario C: the README's first session, as written ------------------------------------


def test_the_readmes_first_session_runs_as_written_within_its_first_80_lines(kandev_factory) -> None:
    """Issue 23 scenario C: the README's first 80 lines take a new user from the clone to a
    followed turn. The "First session" block is run line by line through the real CLI, the
    example ids (`1e9c`, `ec47`) replaced by the ids the previous lines printed."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index("## First session")
    block: list[str] = []
    last = start
    for number, line in enumerate(lines[start + 1:], start + 2):  # 1-based line numbers
        if block and not line.startswith("    "):
            break
        if line.startswith("    kandev "):
            block.append(re.sub(r"\s+#.*$", "", line.strip()))
            last = number
    end = last
    assert end <= 80 and any("--follow" in c for c in block), (end, block)
    assert any(line.strip().startswith('export PATH="$PWD/.venv/bin:$PATH"') for line in lines[:start])

    k = kandev_factory("readme")
    ids: dict[str, str] = {}
    outputs = []
    for command in block:
        for example, real in ids.items():
            command = command.replace(f" {example}", f" {real}")
        p = k.human(*shlex.split(command)[1:], timeout=450)
        assert p.returncode == 0, (command, p.stdout, p.stderr)
        outputs.append((command, p.stdout))
        if m := re.search(r"Created task (\w{8})", p.stdout):
            ids["1e9c"] = m.group(1)
        if m := re.search(r"Started session (\w{8})", p.stdout):
            ids["ec47"] = m.group(1)
        if command.startswith("kandev up"):
            st = k.status()
            k.backend_pids.add(int(st["backend"]["pid"]))
            if st["control_server"]["pid"]:  # `up --survival`: a detached server outlives `down`
                k.server_pids.add(int(st["control_server"]["pid"]))
    followed = "\n".join(out for command, out in outputs if "--follow" in command)
    assert "echo: hello" in followed and "3/3" in followed and "[turn ended: end_turn]" in followed
