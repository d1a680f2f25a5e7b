"""Issue 45 scenario B under real systemd (sdbox): the packaged units, survival on, ``agents.max_memory``.

The control server runs as ``kandev`` in ``kandev-agentctl.service`` (``Delegate=yes``). Where it
can make its agents' memory cgroups, an agent that allocates past its bound is killed alone and
reported ``agent_killed`` / ``memory`` while the unit keeps running. Where it cannot (this copy of
sdbox boots a hybrid container whose v1 memory hierarchy is read-only to it), ``kandev status``
and ``kandev doctor`` say that memory is unbounded and why, and agents still start and answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.sdbox import SdBox

HOME = "/var/lib/kandev"
BOUND = 192 * 1024 * 1024
pytestmark = pytest.mark.timeout(300)


def kandev(box: SdBox, *args: str) -> dict[str, Any]:
    proc = box.run(str(box.venv_bin / "kandev"), "--home", HOME, "--json", *args, check=False, timeout=120)
    assert proc.returncode == 0, f"kandev {args}: rc={proc.returncode} {proc.stderr} {proc.stdout}"
    return json.loads(proc.stdout)


def agent_text(box: SdBox, sid: str) -> list[str]:
    return [m["text"] for m in kandev(box, "session", "show", sid)["transcript"] if m["kind"] == "agent_message_chunk"]


def test_issue_45_scenario_b_under_the_units_memory_is_bounded_or_said_unbounded(sdbox: SdBox) -> None:
    """Issue 45 scenario B under systemd: bounded, an agent past ``max_memory`` is killed alone
    (``agent_killed: memory``), its neighbour answers and the unit stays active; unbounded, status and
    doctor say so with the reason and agents work as before."""
    sdbox.install_units()
    sdbox.write_file("/etc/kandev/kandev.toml", '[features]\nagent_survival = true\n[agents]\nmax_memory = "192M"\n')
    sdbox.systemctl("start", "kandev-backend.service")
    assert sdbox.prop("kandev-agentctl.service", "Delegate") == "yes"
    sids = []
    for title in ("a", "b"):
        task = kandev(sdbox, "task", "create", "--title", title)["task_id"]
        sids.append(kandev(sdbox, "session", "start", task)["session_id"])
    a, b = sids
    status = kandev(sdbox, "status")
    memory = status["memory"]
    assert memory["max_memory"] == BOUND
    server = status["control_server"]["pid"]
    if not memory["bounded"]:
        assert memory["reason"], memory
        checks = {c["name"]: c for c in json.loads(sdbox.run(str(sdbox.venv_bin / "kandev"), "--home", HOME, "--json",
                                                             "doctor", check=False).stdout)["checks"]}
        assert not checks["agent_memory"]["ok"] and "UNBOUNDED" in checks["agent_memory"]["detail"]
        assert memory["reason"] in checks["agent_memory"]["detail"] and checks["agent_memory"]["hint"]
        human = sdbox.run(str(sdbox.venv_bin / "kandev"), "--home", HOME, "status", check=False).stdout
        assert "memory is unbounded" in human, human
        kandev(sdbox, "prompt", a, "/alloc 8", "--wait")
        assert agent_text(sdbox, a)[-1] == "alloc: 8 MiB"
        return
    sdbox.run(str(sdbox.venv_bin / "kandev"), "--home", HOME, "--json", "prompt", a, "/alloc 1024", "--wait",
              check=False, timeout=120)
    assert sdbox.wait_for(lambda: kandev(sdbox, "session", "show", a)["state"] == "FAILED", timeout=60)
    assert (kandev(sdbox, "session", "show", a).get("last_error") or "").startswith("agent_killed: memory")
    kandev(sdbox, "prompt", b, "still here", "--wait")
    assert agent_text(sdbox, b)[-1] == "echo: still here"
    assert sdbox.prop("kandev-agentctl.service", "ActiveState") == "active"
    assert kandev(sdbox, "status")["control_server"]["pid"] == server
    killed = sdbox.journal_json("KANDEV_EVENT=agent_killed")
    assert [e.get("REASON") for e in killed] == ["memory"], killed
