"""Backend N with control server N-1 (Issue 15 item 5), with the real previous release.

The previous release is built from this repository's history (``tests/support/releases.py``: the tag
``v<version>`` or the recorded commit, a ``git clone`` and a venv of its own, cached under
/var/tmp). Its backend and control server run with agent survival on and no service manager, a
mock session mid-``/slow``; its backend is SIGKILLed; the current backend starts on the same home,
adopts the old server (adoption requires nothing the old release lacks) and re-tracks the session:
every chunk once and in order. The old server cannot reload (protocol 1.0): it keeps serving its
agent, is refused new agents while the sandbox is required (it has none: Issue 10 with Issue 15),
and the current backend replaces it through its link once it runs no instance (no loss), never by
stopping an agent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from daemon.version import VERSION
from tests.support.kandev import Kandev
from tests.support.processes import alive
from tests.support.releases import previous_release, release_venv
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

N = 20
pytestmark = pytest.mark.timeout(900)  # the first run builds the previous release's venv


class OldKandev(Kandev):
    """The same home driven through the previous release's own CLI and interpreter."""

    def __init__(self, home: Path, env: dict[str, str], python: Path, cwd: Path) -> None:
        super().__init__(home, env)
        self.python = python
        self.cwd = cwd

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.python), "-m", "daemon.cli", "--home", str(self.home), "--json", *args],
                              capture_output=True, text=True, env=self.env, timeout=timeout, cwd=self.cwd)


def test_backend_adopts_previous_release_server_and_replaces_it_when_idle(kandev_factory: Any,
                                                                           short_tmp: Path) -> None:
    """Issue 15 item 5 (version skew): adopt N-1, re-track its session, never kill its agents,
    replace it once it runs no instance."""
    release = previous_release()
    python = release_venv(release)
    new = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    env = {k: v for k, v in new.env.items() if k != "PYTHONPATH"}  # the old code only, never ours
    old = OldKandev(new.home, env, python, cwd=short_tmp)
    versions = old.run("status")  # unreachable, but proves the interpreter runs the old CLI
    assert versions.returncode == 3, versions.stderr

    st = old.up()
    assert st["capability"]["state"] == "enabled" and st["control_server"]["mode"] == "detached"
    assert st["backend"]["version"] == release.version and "can_reload" not in st["control_server"]
    old_server = int(st["control_server"]["pid"])
    new.server_pids.add(old_server)
    task, sid = old.start_session("skew")
    old.cli("prompt", sid, f"/slow {N}")
    show = wait_until(lambda: s if len(agent_chunks(s := old.show(sid))) >= 2 else None, timeout=60)
    agent = (int(show["agent_pid"]), float(show["agent_pid_start_time"]))
    new.agent_pids.add(agent[0])
    os.kill(int(st["backend"]["pid"]), signal.SIGKILL)
    wait_until(lambda: not alive(int(st["backend"]["pid"])), timeout=30)

    st = new.up()  # the current code, same home: migrations, adoption, re-tracking
    assert st["backend"]["version"] == VERSION
    assert st["adoption"]["outcome"] == "adopted", st["adoption"]
    assert st["recovery"]["retracked"] == 1
    ctl = st["control_server"]
    assert int(ctl["pid"]) == old_server and ctl["protocol_version"] == [1, 0]
    assert ctl["can_reload"] is False and ctl["version"] is None and ctl["installed_version"] == VERSION
    assert ctl["replacement"] == "when_idle"
    refused = new.run("agentctl", "reload")
    assert refused.returncode == 1 and json.loads(refused.stdout)["error"]["code"] == "reload_unsupported"
    show = wait_until(lambda: s if (s := new.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=N + 60)
    assert show["retracked"] and (show["agent_pid"], show["agent_pid_start_time"]) == agent
    assert agent_chunks(show) == [f"{i}/{N} " for i in range(1, N + 1)]
    assert [(t["state"], t["stop_reason"]) for t in show["turns"]] == [("finished", "end_turn")]

    # meanwhile the old server, which has no agent sandbox, gets no new agent: agents.sandbox is
    # "required" (the default), so the launch is refused (typed, retryable) instead of starting the
    # agent unsandboxed; the server is not replaced while its agent runs, and status says why
    sandbox = new.status()["sandbox"]
    assert sandbox["sandboxed"] is False and "predates the agent sandbox" in sandbox["reason"]
    task2 = new.cli("task", "create", "--title", "while outdated")["task_id"]
    refused = new.run("session", "start", task2)
    error = json.loads(refused.stdout)["error"]
    assert refused.returncode == 1 and error["code"] == "sandbox_unavailable" and error["retryable"], error
    assert "predates the agent sandbox" in error["message"]
    assert int(new.status()["control_server"]["pid"]) == old_server and alive(agent[0])

    # its last agent ends: then, and only then, the old server is replaced by the current version
    # (through its link: no loss, nothing repaired)
    new.cli("prompt", sid, "/exit 0")
    st = wait_until(lambda: s if (s := new.status())["control_server"]["replacement"] is None else None, timeout=90)
    ctl = st["control_server"]
    assert ctl["last_replaced"]["old_pid"] == old_server and int(ctl["pid"]) != old_server
    assert ctl["version"] == VERSION and ctl["can_reload"] is True
    new.server_pids.add(int(ctl["pid"]))
    wait_until(lambda: not alive(old_server), timeout=30)
    assert not alive(agent[0])  # it ended by itself (/exit 0) before the replacement
    assert ctl["state"] == "running" and ctl["replacements"] == 1 and ctl["last_loss"] is None
    assert ctl["restarts"] == 0
    assert "control_server_lost" not in (new.home / "logs" / "backend.log").read_text()
    _, sid3 = new.start_session("after the replacement")
    assert new.cli("prompt", sid3, "hello", "--wait")["stop_reason"] == "end_turn"
    assert new.status()["sandbox"]["sandboxed"] is True


def test_previous_release_store_is_migrated_with_sessions_mid_turn(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 24 item 1 (its acceptance): a store made by the previous release with sessions mid-turn
    is migrated by the current backend with survival on: every agent re-tracked, every chunk once
    and in order before and after the migration, and a cursor a client got from the old backend
    still names the same place in the transcript."""
    python = release_venv(previous_release())
    new = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    env = {k: v for k, v in new.env.items() if k != "PYTHONPATH"}
    old = OldKandev(new.home, env, python, cwd=short_tmp)
    st = old.up()
    new.server_pids.add(int(st["control_server"]["pid"]))
    sids = []
    for i in range(2):  # two sessions: the old store's rows interleave
        _, sid = old.start_session(f"mid-turn {i}")
        old.cli("prompt", sid, f"/slow {N}")
        sids.append(sid)
    shows = {sid: wait_until(lambda sid=sid: s if len(agent_chunks(s := old.show(sid))) >= 3 else None, timeout=60)
             for sid in sids}
    before = {sid: [(e["cursor"], e["text"]) for e in old.show(sid)["transcript"]] for sid in sids}  # a prefix
    os.kill(int(st["backend"]["pid"]), signal.SIGKILL)
    wait_until(lambda: not alive(int(st["backend"]["pid"])), timeout=30)
    agents = {sid: int(shows[sid]["agent_pid"]) for sid in sids}
    new.agent_pids.update(agents.values())

    st = new.up()  # migrates the store, adopts the old server, re-tracks both agents
    assert st["backend"]["version"] == VERSION and st["recovery"]["retracked"] == 2, st["recovery"]
    for sid in sids:
        done = wait_until(lambda sid=sid: s if (s := new.show(sid))["state"] == "WAITING_FOR_INPUT" else None,
                          timeout=N + 90)
        assert done["retracked"] and int(done["agent_pid"]) == agents[sid] and alive(agents[sid])
        assert [(t["state"], t["stop_reason"]) for t in done["turns"]] == [("finished", "end_turn")]
        full = new.transcript(sid)
        assert [e["text"] for e in full if e["kind"] == "agent_message_chunk"] == [f"{i}/{N} " for i in range(1, N + 1)]
        assert [(e["cursor"], e["text"]) for e in full][:len(before[sid])] == before[sid]  # the same cursors
        cursors = [e["cursor"] for e in full]
        assert cursors == sorted(set(cursors))
        after = new.cli("session", "show", sid, "--after-seq", str(before[sid][-1][0]))["transcript"]
        assert [(e["cursor"], e["text"]) for e in after] == [(e["cursor"], e["text"]) for e in full[len(before[sid]):]]
