"""Issue 2 scenario D under real systemd (sdbox): the units from units/, survival switched on.

``systemctl kill -s KILL kandev-backend`` and ``systemctl restart
kandev-backend`` each leave the same agent process running and re-tracked;
``systemctl stop kandev-agentctl`` stops every agent; ``journalctl -o json``
shows the adoption and each re-tracked session as structured fields.

Issue 10 scenario A and Issue 10 scenario B under real systemd: the re-tracked agent of Issue 2 scenario D is attacked
from inside (``/sh``, a GitHub token configured in /etc/kandev, which the agent's read-only /etc
must not show) and reaches nothing of kandev; with the control-server unit restricted by a drop-in
(``RestrictNamespaces=yes``) a session start fails with ``sandbox_unavailable`` and doctor says
why; with survival unavailable (the control server a child of the backend unit) agents are
sandboxed inside the backend unit too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.sandbox_attacks import attack_script, attack_verdicts, connect_argv
from tests.support.sdbox import SdBox

HOME = "/var/lib/kandev"
TOKEN_FILE = "/etc/kandev/github-token"
UPSTREAM = "ghp_SDBOXupstreamToken0123456789abcdefgh"
REPO = f"{HOME}/repos/repo"
pytestmark = pytest.mark.timeout(300)


class BoxCli:
    def __init__(self, box: SdBox) -> None:
        self.box = box

    def __call__(self, *args: str) -> dict[str, Any]:
        proc = self.box.run(str(self.box.venv_bin / "kandev"), "--home", HOME, "--json", *args, check=False,
                            timeout=120)
        assert proc.returncode == 0, f"kandev {args}: rc={proc.returncode} {proc.stderr} {proc.stdout}"
        return json.loads(proc.stdout)

    def show(self, sid: str) -> dict[str, Any]:
        return self("session", "show", sid)

    def says(self, sid: str, prompt: str) -> str:
        self("prompt", sid, prompt, "--wait")
        return chunks(self.show(sid))[-1]


def chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


@pytest.fixture(scope="module")
def booted(sdbox: SdBox) -> SdBox:
    sdbox.install_units()
    sdbox.write_file("/etc/kandev/kandev.toml", "[features]\nagent_survival = true\n"
                     f'[credentials]\ngithub_token_file = "{TOKEN_FILE}"\n')
    sdbox.write_file(TOKEN_FILE, UPSTREAM + "\n", mode=0o600)
    sdbox.run("chown", "kandev:kandev", TOKEN_FILE)
    sdbox.systemctl("start", "kandev-backend.service")  # Type=notify: returns once READY=1
    # a GitHub-backed workspace of the kandev user, under the home (the units' only writable place)
    sdbox.run("runuser", "-u", "kandev", "--", "mkdir", "-p", REPO)
    sdbox.run("runuser", "-u", "kandev", "--", "git", "init", "-q", REPO)
    sdbox.run("runuser", "-u", "kandev", "--", "git", "-C", REPO, "remote", "add", "origin",
              "https://github.com/example/repo.git")
    return sdbox


def attack(box: SdBox, cli: BoxCli, sid: str, other_sid: str) -> None:
    """Issue 10 scenario A from inside the agent of ``sid``: every denied attempt fails, every
    allowed one succeeds, and git authenticates through the session's own endpoint."""
    st = cli("status")
    other = cli.show(other_sid)
    secrets = box.run("ls", f"{HOME}/secrets").stdout.split()
    assert any(n.startswith("agentctl-cred-") for n in secrets), secrets
    denied = {
        "token_file": ["cat", TOKEN_FILE],
        "store": ["cat", f"{HOME}/kandev.db"],
        "secrets_dir": ["ls", f"{HOME}/secrets"],
        **{f"secret_{i}": ["cat", f"{HOME}/secrets/{n}"] for i, n in enumerate(secrets)},
        "run_dir": ["ls", f"{HOME}/run"],
        "logs_dir": ["ls", f"{HOME}/logs"],
        "other_workspace": ["ls", box.run("sh", "-c", f"ls -d {HOME}/worktrees/*").stdout.split()[0]],
        "other_session": ["ls", f"{HOME}/sessions/{other_sid}"],
        "backend_environ": ["cat", f"/proc/{st['backend']['pid']}/environ"],
        "backend_socket": connect_argv(st["backend"]["socket"]),
        "agentctl_socket": connect_argv(st["control_server"]["endpoint"]),
        "kill_backend": ["kill", "-0", str(st["backend"]["pid"])],
        "kill_agentctl": ["kill", "-0", str(st["control_server"]["pid"])],
        "kill_other_agent": ["kill", "-0", str(other["agent_pid"])],
    }
    allowed = {
        "write_workspace": ["sh", "-c", "echo hi > probe.txt && test \"$(cat probe.txt)\" = hi"],
        "git": ["git", "status", "--porcelain"],
        "python3": ["python3", "-c", "print(6 * 7)"],
    }
    said = cli.says(sid, "/sh " + attack_script(denied, allowed))
    assert said.startswith("sh: exit=0\n") and not attack_verdicts(said, denied, allowed), said
    # The session's lease checks at its endpoint; no credential is handed out (Issue 20).
    said = cli.says(sid, "/git-credential")
    assert said.startswith("git-credential: ok repository=github.com/") and UPSTREAM not in said, said


def _main_pid(box: SdBox, unit: str) -> str:
    return box.prop(unit, "MainPID")


def _assert_same_agent_retracked(box: SdBox, cli: BoxCli, sid: str, pid: int, start: float) -> None:
    show = box.wait_for(lambda: s if (s := cli.show(sid))["retracked"] else None, timeout=30)
    assert show, "session was not re-tracked"
    assert show["state"] == "RUNNING"
    assert show["agent_pid"] == pid and show["agent_pid_start_time"] == start
    assert box.alive(pid)


def test_scenario_d_survives_kill_and_restart_then_stop_control_server(booted: SdBox):
    """AC-EXECUTORS-SURVIVAL-001.1, AC-EXECUTORS-SURVIVAL-001.2, AC-EXECUTORS-SURVIVAL-001.4 under systemd; journald fields read back."""
    box, cli = booted, BoxCli(booted)
    st = cli("status")
    assert st["capability"]["state"] == "enabled" and st["capability"]["supervisor"] == "systemd"
    assert st["control_server"]["mode"] == "unit"
    assert box.prop("kandev-agentctl.service", "ActiveState") == "active"
    ctl_pid = _main_pid(box, "kandev-agentctl.service")

    task = cli("task", "create", "--title", "systemd survival")["task_id"]
    sid = cli("session", "start", task)["session_id"]
    cli("prompt", sid, "/slow 300")  # still running after two restarts on a loaded machine; the unit stop ends it
    show = box.wait_for(lambda: s if len(chunks(s := cli.show(sid))) >= 2 else None, timeout=30)
    assert show and show["state"] == "RUNNING"
    pid, start = show["agent_pid"], show["agent_pid_start_time"]

    # 1. SIGKILL of the backend: systemd restarts it (Restart=on-failure); the agent lives on.
    old = _main_pid(box, "kandev-backend.service")
    box.systemctl("kill", "-s", "KILL", "kandev-backend.service")
    assert box.wait_for(
        lambda: _main_pid(box, "kandev-backend.service") not in ("0", old)
        and box.prop("kandev-backend.service", "ActiveState") == "active",
        timeout=60,
    ), "backend was not restarted after SIGKILL"
    _assert_same_agent_retracked(box, cli, sid, pid, start)
    assert _main_pid(box, "kandev-agentctl.service") == ctl_pid

    # 2. systemctl restart: a graceful stop detaches, the new backend adopts.
    box.systemctl("restart", "kandev-backend.service")
    _assert_same_agent_retracked(box, cli, sid, pid, start)
    assert _main_pid(box, "kandev-agentctl.service") == ctl_pid
    assert cli("status")["adoption"]["outcome"] == "adopted"

    # journald: the adoption and each re-tracked session as structured fields.
    adoptions = box.journal_json("KANDEV_EVENT=adoption", "OUTCOME=adopted")
    assert len(adoptions) >= 2
    assert all(a["_SYSTEMD_UNIT"] == "kandev-backend.service" for a in adoptions)
    retracked = box.journal_json("KANDEV_EVENT=session_retracked", f"SESSION_ID={sid}")
    assert len(retracked) >= 2
    assert {r["AGENT_PID"] for r in retracked} == {str(pid)}
    assert {r["INSTANCE_ID"] for r in retracked} == {show["instance_id"]}

    # Issue 10 scenario A under systemd, on a re-tracked agent.
    gh_task = cli("task", "create", "--title", "github", "--workspace", REPO)["task_id"]
    gh_sid = cli("session", "start", gh_task)["session_id"]
    gh = cli.show(gh_sid)
    old = _main_pid(box, "kandev-backend.service")
    box.systemctl("kill", "-s", "KILL", "kandev-backend.service")
    assert box.wait_for(
        lambda: _main_pid(box, "kandev-backend.service") not in ("0", old)
        and box.prop("kandev-backend.service", "ActiveState") == "active",
        timeout=60,
    ), "backend was not restarted after SIGKILL"
    assert box.wait_for(lambda: cli.show(gh_sid)["retracked"], timeout=60)
    assert (cli.show(gh_sid)["agent_pid"], cli.show(gh_sid)["agent_pid_start_time"]) == (
        gh["agent_pid"], gh["agent_pid_start_time"])
    assert cli("status")["sandbox"]["sandboxed"] is True
    attack(box, cli, gh_sid, sid)
    # Issue 44 scenario E under the units: the agents' system-call filter loads below the units' own
    assert cli("status")["sandbox"]["seccomp"].startswith("kandev-seccomp/")
    held = cli.says(gh_sid, "/sh grep '^Seccomp:' /proc/self/status; unshare -Ur true 2>/dev/null || echo refused")
    assert held.split("\n")[1:3] == ["Seccomp:\t2", "refused"], held

    # 3. systemctl stop of the control server stops every agent (KillMode=control-group).
    box.systemctl("stop", "kandev-agentctl.service")
    assert box.wait_for(lambda: not box.alive(pid), timeout=20), "agent outlived its control server"
    assert box.wait_for(lambda: not box.alive(gh["agent_pid"]), timeout=20), "agent outlived its control server"


def test_scenario_b_a_unit_that_forbids_namespaces_refuses_agents_and_doctor_says_why(booted: SdBox):
    """Issue 10 scenario B under systemd: a drop-in gives the control-server unit
    RestrictNamespaces=yes (bubblewrap cannot make a sandbox there): session start fails with
    sandbox_unavailable, the session ends FAILED, status and doctor (as root) say why."""
    box, cli = booted, BoxCli(booted)
    dropin = "/etc/systemd/system/kandev-agentctl.service.d/no-namespaces.conf"
    box.systemctl("stop", "kandev-backend.service", "kandev-agentctl.service")
    box.write_file(dropin, "[Service]\nRestrictNamespaces=yes\n")
    box.systemctl("daemon-reload")
    try:
        box.systemctl("start", "kandev-backend.service")
        assert box.prop("kandev-agentctl.service", "RestrictNamespaces") == "yes"
        task = cli("task", "create", "--title", "no sandbox")["task_id"]
        proc = box.run(str(box.venv_bin / "kandev"), "--home", HOME, "--json", "session", "start", task,
                       check=False, timeout=120)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        error = json.loads(proc.stdout)["error"]
        assert error["code"] == "sandbox_unavailable" and "agents.sandbox" in error["message"], error
        failed = [s for s in cli("session", "list")["sessions"] if s["task_id"] == task]
        assert [s["state"] for s in failed] == ["FAILED"]
        assert "sandbox" in cli.show(failed[0]["session_id"])["last_error"]
        sandbox = cli("status")["sandbox"]
        assert sandbox["sandboxed"] is False and "cannot make a sandbox" in sandbox["reason"], sandbox
        doctor = json.loads(box.run(str(box.venv_bin / "kandev"), "--home", HOME, "--json", "doctor",
                                    check=False).stdout)
        check = next(c for c in doctor["checks"] if c["name"] == "sandbox")
        assert not check["ok"] and "cannot make a sandbox" in check["detail"] and "RestrictNamespaces" in check["hint"]
    finally:
        box.run("rm", "-f", dropin)
        box.systemctl("stop", "kandev-backend.service", "kandev-agentctl.service")
        box.systemctl("daemon-reload")
        box.systemctl("start", "kandev-backend.service")


def test_unit_missing_reports_unavailable_and_behaves_disabled(booted: SdBox):
    """AC-EXECUTORS-SURVIVAL-005.4: switched on, but the control-server unit is not installed: the
    capability is reported unavailable with its reason (not disabled), in status, STATUS= and the
    journal, and the backend behaves as disabled (a child control server)."""
    box, cli = booted, BoxCli(booted)
    box.systemctl("stop", "kandev-backend.service")
    box.run("rm", "-f", "/etc/systemd/system/kandev-agentctl.service")
    box.systemctl("daemon-reload")
    box.systemctl("start", "kandev-backend.service")
    st = cli("status")
    assert st["capability"]["state"] == "unavailable" and st["capability"]["reason"] == "unit_missing"
    assert st["control_server"]["mode"] == "child"
    assert "capability=unavailable(unit_missing)" in box.prop("kandev-backend.service", "StatusText")
    entries = box.journal_json("KANDEV_EVENT=capability", "STATE=unavailable")
    assert entries and entries[-1]["REASON"] == "unit_missing"
    # Issue 10: the control server is the backend unit's child now; the backend unit admits bubblewrap too.
    gh_task = cli("task", "create", "--title", "github child", "--workspace", REPO)["task_id"]
    gh_sid = cli("session", "start", gh_task)["session_id"]
    other_sid = cli("session", "start", cli("task", "create", "--title", "other")["task_id"])["session_id"]
    assert cli("status")["sandbox"]["sandboxed"] is True
    attack(box, cli, gh_sid, other_sid)
