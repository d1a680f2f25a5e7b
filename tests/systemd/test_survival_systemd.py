"""Issue scenario D under real systemd (sdbox): the units from units/, survival switched on.

``systemctl kill -s KILL kandev-backend`` and ``systemctl restart
kandev-backend`` each leave the same agent process running and re-tracked;
``systemctl stop kandev-agentctl`` stops every agent; ``journalctl -o json``
shows the adoption and each re-tracked session as structured fields.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.systemd.harness import SdBox

HOME = "/var/lib/kandev"
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


def chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


@pytest.fixture(scope="module")
def booted(sdbox: SdBox) -> SdBox:
    sdbox.install_units()
    sdbox.write_file("/etc/kandev/kandev.toml", "[features]\nagent_survival = true\n")
    sdbox.systemctl("start", "kandev-backend.service")  # Type=notify: returns once READY=1
    return sdbox


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
    cli("prompt", sid, "/slow 40")
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

    # 3. systemctl stop of the control server stops every agent (KillMode=control-group).
    box.systemctl("stop", "kandev-agentctl.service")
    assert box.wait_for(lambda: not box.alive(pid), timeout=20), "agent outlived its control server"


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
