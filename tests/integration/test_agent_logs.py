"""The control server bounds the agents' stderr files: at its start it prunes old files of
instances it does not run (the size cap is covered in tests/unit/test_agentctl_agent_logs.py)."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_control_server_prunes_old_agent_stderr_files_at_start(kandev_factory):
    k = kandev_factory()
    agents = k.home / "logs" / "agents"
    agents.mkdir(parents=True, mode=0o700)
    old = agents / ("a" * 32 + ".stderr.log")
    recent = agents / ("b" * 32 + ".stderr.log")
    for p in (old, recent):
        p.write_text("agent noise\n")
    then = time.time() - 15 * 24 * 3600
    os.utime(old, (then, then))
    k.up()
    _, sid = k.start_session("logs")
    wait_until(lambda: not old.exists(), timeout=30)
    assert recent.exists()
    live = agents / f"{k.show(sid)['instance_id']}.stderr.log"
    assert live.exists()
    text = (k.home / "logs" / "agentctl.log").read_text()
    assert "agent_logs_pruned" in text and "removed 1 agent stderr file(s)" in text
