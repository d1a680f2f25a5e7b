"""``systemctl reload kandev-agentctl`` under real systemd (sdbox, the units from units/; Issue 15).

The unit's ``ExecReload=`` runs ``kandev-agentctl --reload --pid $MAINPID``: SIGHUP to the main
process, then it waits for the re-exec's outcome, so ``systemctl reload`` returns once the new code
serves. Same MainPID, same unit and cgroup, same agent; systemd counts no restart; the journal of
the unit has the re-exec as structured fields. A broken new version makes ``systemctl reload`` fail
while the unit stays active on the old code (Issue 15 scenario C under systemd).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.sdbox import SdBox

HOME = "/var/lib/kandev"
AGENTCTL = "kandev-agentctl.service"
pytestmark = pytest.mark.timeout(300)


def _cli(box: SdBox, *args: str) -> dict[str, Any]:
    proc = box.run(str(box.venv_bin / "kandev"), "--home", HOME, "--json", *args, check=False, timeout=120)
    assert proc.returncode == 0, f"kandev {args}: rc={proc.returncode} {proc.stderr} {proc.stdout}"
    return json.loads(proc.stdout)


def _chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


@pytest.fixture(scope="module")
def booted(sdbox: SdBox) -> SdBox:
    sdbox.install_units()
    sdbox.write_file("/etc/kandev/kandev.toml", "[features]\nagent_survival = true\n")
    sdbox.systemctl("start", "kandev-backend.service")
    return sdbox


def test_systemctl_reload_reexecutes_in_place(booted: SdBox) -> None:
    """Issue 15 item 1 and Issue 15 item 4 under systemd: a reload is a re-exec of the same main process."""
    box = booted
    assert _cli(box, "status")["control_server"]["mode"] == "unit"
    pid, restarts = box.prop(AGENTCTL, "MainPID"), box.prop(AGENTCTL, "NRestarts")
    cgroup = box.prop(AGENTCTL, "ControlGroup")
    task = _cli(box, "task", "create", "--title", "reload")["task_id"]
    sid = _cli(box, "session", "start", task)["session_id"]
    _cli(box, "prompt", sid, "/slow 25")
    show = box.wait_for(lambda: s if len(_chunks(s := _cli(box, "session", "show", sid))) >= 2 else None, timeout=30)
    assert show
    agent = (show["agent_pid"], show["agent_pid_start_time"])

    for _ in range(2):
        done = box.run("systemctl", "reload", AGENTCTL, check=False, timeout=120)
        assert done.returncode == 0, (done.stdout, done.stderr,
                                      box.run("journalctl", "-u", AGENTCTL, "--no-pager", "-n", "30").stdout)
    assert box.prop(AGENTCTL, "MainPID") == pid and box.prop(AGENTCTL, "NRestarts") == restarts
    assert box.prop(AGENTCTL, "ActiveState") == "active" and box.prop(AGENTCTL, "SubState") == "running"
    assert box.prop(AGENTCTL, "ControlGroup") == cgroup
    assert box.run("cat", f"/proc/{agent[0]}/cgroup").stdout.strip().endswith(cgroup)  # still in its cgroup
    ctl = _cli(box, "status")["control_server"]
    assert ctl["reexec_count"] == 2 and str(ctl["pid"]) == pid and ctl["can_reload"]
    entries = box.journal_json("-u", AGENTCTL, "KANDEV_EVENT=agentctl_reexecuted")
    assert len(entries) == 2 and {e["_PID"] for e in entries} == {pid}
    show = box.wait_for(lambda: s if (s := _cli(box, "session", "show", sid))["state"] == "WAITING_FOR_INPUT"
                        else None, timeout=60)
    assert show and (show["agent_pid"], show["agent_pid_start_time"]) == agent
    assert _chunks(show) == [f"{i}/25 " for i in range(1, 26)]


def test_systemctl_reload_of_a_broken_version_fails_and_keeps_serving(booted: SdBox) -> None:
    """Issue 15 scenario C under systemd: the next exec would import a module that raises, so the
    preflight refuses; ``systemctl reload`` fails (the helper exits 1), the unit stays active with
    the same main process, and the journal entry says why."""
    box = booted
    pid = box.prop(AGENTCTL, "MainPID")
    # What an upgrade would do: replace, where the next exec loads it, a module with one that raises
    # (inside the box only: its root is an overlay, the host's checkout is never touched).
    module = box.repo_root / "daemon" / "agentctl" / "instance" / "instance.py"
    box.run("cp", "-p", str(module), "/var/lib/instance.py.orig")
    box.run("sh", "-c", f"cp -p {module} {module}.new && echo 'raise RuntimeError(\"broken on purpose\")' >> "
                        f"{module}.new && mv {module}.new {module}")
    try:
        done = box.run("systemctl", "reload", AGENTCTL, check=False, timeout=120)
        assert done.returncode != 0
        assert box.prop(AGENTCTL, "MainPID") == pid and box.prop(AGENTCTL, "ActiveState") == "active"
        refused = box.journal_json("-u", AGENTCTL, "KANDEV_EVENT=reload_refused")
        assert refused and "broken on purpose" in refused[-1]["REASON"], refused
    finally:
        box.run("cp", "-p", "/var/lib/instance.py.orig", str(module))
    assert _cli(box, "status")["control_server"]["state"] == "running"
