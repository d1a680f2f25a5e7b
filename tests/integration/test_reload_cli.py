"""Reloading the control server under a running backend, no service manager (Issue 15).

Real daemons through the real CLI: ``kandev up`` with agent survival on (a detached control
server), mock agents mid-turn, then reloads; the backend re-attaches its streams with
``after_seq`` after each one (item 6) and its calls reconnect.

Issue 15 scenario A: ``kandev agentctl reload`` 20 times in a row with 4 sessions mid-``/slow``, one
``/flood 20000`` and one open ``/permission``. The 100 reloads at random moments are in
test_reload_random.py: a module of its own, so that it runs beside this one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from daemon.core.version import VERSION
from tests.support.kandev import Kandev
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive, identity
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

SLOW = 60
FLOOD = 20000
pytestmark = pytest.mark.timeout(1500)  # 100 re-execs: two interpreter starts each (preflight, new image)


def _turn_ends(k: Kandev, sid: str) -> int:
    """How often the backend applied a turn's end to this session (its state log)."""
    text = (k.home / "logs" / "backend.log").read_text(errors="replace")
    return len(re.findall(rf"session_state session_id={sid} .*from_state=RUNNING to_state=WAITING_FOR_INPUT", text))


def _open_permission(show: dict[str, Any]) -> str | None:
    for request in show.get("permissions") or []:
        if request["state"] == "open":
            return str(request["request_id"])
    return None


def test_scenario_a_twenty_reloads_under_running_turns(kandev_factory: Any) -> None:
    """Issue 15 scenario A: 20 reloads in a row (``kandev agentctl reload``): the same agent pids and
    start times, every chunk once and in order, the permission answered after the reloads completes
    its turn, each turn's outcome applied once, the control-server pid unchanged."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    assert st["control_server"]["mode"] == "detached" and st["control_server"]["can_reload"]
    server = identity(int(st["control_server"]["pid"]))
    slow = [k.start_session(f"slow {i}")[1] for i in range(4)]
    flood = k.start_session("flood")[1]
    perm = k.start_session("permission")[1]
    for sid in slow:
        k.cli("prompt", sid, f"/slow {SLOW}")
    k.cli("prompt", flood, f"/flood {FLOOD}")
    k.cli("prompt", perm, "/permission")
    for sid in slow:
        wait_until(lambda sid=sid: len(agent_chunks(k.show(sid))) >= 2, timeout=60, interval=0.3)
    request = wait_until(lambda: _open_permission(k.show(perm)), timeout=60, interval=0.3)
    agents = {sid: identity(int(k.show(sid)["agent_pid"])) for sid in [*slow, flood, perm]}

    outcomes = [k.cli("agentctl", "reload", timeout=200) for _ in range(20)]
    assert [o["outcome"] for o in outcomes] == ["reexecuted"] * 20
    assert {o["pid"] for o in outcomes} == {server[0]}
    assert [o["reexec_count"] for o in outcomes] == list(range(1, 21))

    st = k.status()
    assert identity(int(st["control_server"]["pid"])) == server  # the same process, never restarted
    assert st["control_server"]["reexec_count"] == 20 and st["control_server"]["last_reexec_at"]
    assert all(alive(pid) and identity(pid) == ident for pid, ident in ((a[0], a) for a in agents.values()))
    assert _open_permission(k.show(perm)) == request  # still open: it crossed the 20 re-execs
    k.cli("permission", perm, request, "--option", "allow")

    for sid in [*slow, flood, perm]:
        wait_until(lambda sid=sid: k.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=SLOW + 120, interval=0.5)
    for sid in slow:
        assert agent_chunks(k.show(sid)) == [f"{i}/{SLOW} " for i in range(1, SLOW + 1)]
    # the flood's 20000 chunks outgrow ``session show``'s default page (the last 10000): the store
    flood_chunks = [m["text"] for m in k.transcript(flood) if m["kind"] == "agent_message_chunk"]
    assert flood_chunks == [f"{i}/{FLOOD} " for i in range(1, FLOOD + 1)]
    assert agent_chunks(k.show(perm))[-1] == "permission: allow"
    for sid in [*slow, flood, perm]:
        turns = k.show(sid)["turns"]
        assert [(t["state"], t["stop_reason"]) for t in turns] == [("finished", "end_turn")], (sid, turns)
        assert _turn_ends(k, sid) == 1, f"session {sid}: its turn's end was applied {_turn_ends(k, sid)} times"
        assert identity(agents[sid][0]) == agents[sid]


def test_backend_asks_an_older_server_that_can_reload_to_reload(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 15 item 5: a backend that adopts a control server running an older version that can
    reload asks it to, once ready; the server re-executes the installed (newer) code in place and
    its agent keeps running. Here the older version is a copy of the tree whose daemon/core/version.py
    says 0.1.9; the "upgrade" replaces that file under the running server, as a package would."""
    code = short_tmp / "code"
    for top in ("daemon", "ipc"):
        shutil.copytree(REPO_ROOT / top, code / top, ignore=shutil.ignore_patterns("__pycache__"))
    version_py = code / "daemon" / "core" / "version.py"
    version_py.write_text(version_py.read_text().replace(f'VERSION = "{VERSION}"', 'VERSION = "0.1.9"'))
    old = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    old.env["PYTHONPATH"] = str(code)  # backend and control server of "0.1.9"
    old.cwd = short_tmp  # not the checkout: `python -m` would load the checkout's code first
    st = old.up()
    assert st["backend"]["version"] == "0.1.9" and st["control_server"]["version"] == "0.1.9"
    server = identity(int(st["control_server"]["pid"]))
    _, sid = old.start_session("older")
    old.cli("prompt", sid, "/slow 15")
    show = wait_until(lambda: s if len(agent_chunks(s := old.show(sid))) >= 2 else None, timeout=60)
    agent = identity(int(show["agent_pid"]))
    os.kill(int(st["backend"]["pid"]), signal.SIGKILL)
    wait_until(lambda: not alive(int(st["backend"]["pid"])), timeout=30)
    version_py.write_text(version_py.read_text().replace('VERSION = "0.1.9"', f'VERSION = "{VERSION}"'))

    new = Kandev(old.home, {**old.env, "PYTHONPATH": str(REPO_ROOT)})  # the current backend, same home
    new.backend_pids, new.server_pids, new.agent_pids = old.backend_pids, old.server_pids, old.agent_pids
    st = new.up()
    assert st["adoption"]["outcome"] == "adopted" and st["recovery"]["retracked"] == 1
    ctl = wait_until(lambda: c if (c := new.status()["control_server"])["version"] == VERSION else None, timeout=90)
    assert ctl["reexec_count"] == 1 and ctl["last_reload"]["outcome"] == "reexecuted"
    assert identity(int(ctl["pid"])) == server and identity(agent[0]) == agent
    log = (new.home / "logs" / "backend.log").read_text()
    assert "control_server_outdated" in log and "running_version=0.1.9" in log
    done = wait_until(lambda: s if (s := new.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)
    assert agent_chunks(done) == [f"{i}/15 " for i in range(1, 16)]
