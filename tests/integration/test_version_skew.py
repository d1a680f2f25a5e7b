"""Backend N with control server N-1 (Issue 15 item 5), with the real previous release.

The previous release is built from this repository's history (``tests/support/releases.py``: the tag
``v<version>`` or the recorded commit, a ``git clone`` and a venv of its own, cached under
/var/tmp). Its backend and control server run with agent survival on and no service manager, a
mock session mid-``/slow``; its backend is SIGKILLed; the current backend starts on the same home,
adopts the old server (adoption requires nothing the old release lacks) and re-tracks the session:
every chunk once and in order. The previous release can reload (0.2.0 has ``reload.v1``): once the
files it imports are this version's (swapped in the way a package upgrade does), ``kandev agentctl
reload`` re-executes it in place into this version, which reads the previous release's hand-over;
same pid, the agent untouched. (A 0.1.0 server, which cannot reload and was replaced once idle, is
two releases back: backend N adopts N-1 only.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from daemon.core.version import VERSION
from tests.support.kandev import Kandev, logged_problems
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.releases import previous_release, release_tree, release_venv
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


def _install_code(tree: Path, into: Path) -> None:
    """Put ``tree``'s ``daemon`` and ``ipc`` packages at ``into`` the way a package upgrade does:
    each package is written beside the old one and renamed over it, so a process that already
    imported everything keeps running its code and the next one imports the new."""
    into.mkdir(parents=True, exist_ok=True)
    for pkg in ("daemon", "ipc"):
        staged = into / f".{pkg}.new"
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(tree / pkg, staged, ignore=shutil.ignore_patterns("__pycache__"))
        old = into / f".{pkg}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (into / pkg).exists():
            (into / pkg).rename(old)
        staged.rename(into / pkg)
        shutil.rmtree(old, ignore_errors=True)


def test_backend_adopts_previous_release_server_which_then_reloads_into_this_version(
        kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 15 item 5 (version skew): the current backend adopts a control server of the previous
    release and re-tracks its session; once the installed code is this version, the old server
    reloads in place into it (same pid, its agent untouched, the previous release's hand-over read
    by this version), and every chunk arrives once and in order."""
    release = previous_release()
    python = release_venv(release)
    code = short_tmp / "installed"  # what "installed" means for the old processes: their import path
    _install_code(release_tree(release), code)
    new = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    env = {**{k: v for k, v in new.env.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(code)}
    old = OldKandev(new.home, env, python, cwd=short_tmp)
    versions = old.run("status")  # unreachable, but proves the interpreter runs the old CLI
    assert versions.returncode == 3, versions.stderr

    st = old.up()
    assert st["capability"]["state"] == "enabled" and st["control_server"]["mode"] == "detached"
    assert st["backend"]["version"] == release.version and st["control_server"]["can_reload"] is True
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
    # (on a failure: the status and what the daemons logged as warnings and errors)
    assert ctl["pid"] is not None and int(ctl["pid"]) == old_server, (ctl, logged_problems(new))
    assert ctl["version"] == release.version and ctl["can_reload"] is True, ctl

    # Once ready, this backend (whose own installed code is this version) asks the older server to
    # reload by itself; the old server's installed code is still 0.2.0 here, so that first re-exec
    # runs 0.2.0 again. Let it settle before the upgrade, or its preflight would read a tree half
    # replaced (as one racing a package's unpacking would: refused, the old code keeps serving).
    settled = wait_until(lambda: c if (c := new.status()["control_server"])["last_reload"] is not None
                         and c["last_reload"]["outcome"] is not None else None, timeout=120)
    assert settled["last_reload"]["outcome"] == "reexecuted" and settled["version"] == release.version, settled
    assert int(settled["pid"]) == old_server and alive(agent[0])

    # the upgrade: this version's files replace the old ones under the running server, which goes
    # on running what it imported until it reloads
    _install_code(REPO_ROOT, code)
    assert new.status()["control_server"]["version"] == release.version
    reload = new.run("agentctl", "reload", timeout=240)
    assert reload.returncode == 0, (reload.stdout, reload.stderr)
    ctl = wait_until(lambda: c if (c := new.status()["control_server"])["version"] == VERSION else None, timeout=60)
    assert int(ctl["pid"]) == old_server and ctl["reexec_count"] >= 1 and ctl["can_reload"] is True
    assert alive(old_server) and alive(agent[0])

    show = wait_until(lambda: s if (s := new.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=N + 90)
    assert show["retracked"] and (int(show["agent_pid"]), float(show["agent_pid_start_time"])) == agent
    assert agent_chunks(show) == [f"{i}/{N} " for i in range(1, N + 1)]
    assert [(t["state"], t["stop_reason"]) for t in show["turns"]] == [("finished", "end_turn")]
    assert "control_server_lost" not in (new.home / "logs" / "backend.log").read_text()
    # (no new session here: the old processes' sandbox binds their own venv, not this test's, and the
    # mock agent's command is this venv's python; under a package both are one, see test_package_skew)
    ctl = new.status()["control_server"]
    assert ctl["state"] == "running" and int(ctl["pid"]) == old_server and ctl["restarts"] == 0


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
