"""Reloading the control server under a running backend, no service manager (Issue 15).

Real daemons through the real CLI: ``kandev up`` with agent survival on (a detached control
server), mock agents mid-turn, then reloads; the backend re-attaches its streams with
``after_seq`` after each one (item 6) and its calls reconnect.

Issue 15 scenario A: ``kandev agentctl reload`` 20 times in a row with 4 sessions mid-``/slow``, one
``/flood 20000`` and one open ``/permission``. Issue 15 scenario D: 100 reloads at random moments
(mid-frame, mid-attach, mid-rotation: the backend is restarted, so adopts and rotates, while the
reloads go on) with a backend attached.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.agentctl.reload_client import read_status
from daemon.version import VERSION
from tests.support.kandev import CliError, Kandev, db_row, db_rows
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

SLOW = 60
FLOOD = 20000
pytestmark = pytest.mark.timeout(1500)  # 100 re-execs: two interpreter starts each (preflight, new image)


def _identity(pid: int) -> tuple[int, float]:
    return pid, psutil.Process(pid).create_time()


def _turn_ends(k: Kandev, sid: str) -> int:
    """How often the backend applied a turn's end to this session (its state log)."""
    text = (k.home / "logs" / "backend.log").read_text(errors="replace")
    return len(re.findall(rf"session_state session_id={sid} .*from_state=RUNNING to_state=WAITING_FOR_INPUT", text))


def _problems(k: Kandev) -> str:
    """Warnings and errors both daemons logged (shown with a failure)."""
    lines = []
    for name in ("backend.log", "agentctl.log"):
        path = k.home / "logs" / name
        if path.exists():
            lines += [f"{name}: {line[:400]}" for line in path.read_text(errors="replace").splitlines()
                      if " WARNING " in line or " ERROR " in line]
    return "\n".join(lines[-60:])


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
    server = _identity(int(st["control_server"]["pid"]))
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
    agents = {sid: _identity(int(k.show(sid)["agent_pid"])) for sid in [*slow, flood, perm]}

    outcomes = [k.cli("agentctl", "reload", timeout=200) for _ in range(20)]
    assert [o["outcome"] for o in outcomes] == ["reexecuted"] * 20
    assert {o["pid"] for o in outcomes} == {server[0]}
    assert [o["reexec_count"] for o in outcomes] == list(range(1, 21))

    st = k.status()
    assert _identity(int(st["control_server"]["pid"])) == server  # the same process, never restarted
    assert st["control_server"]["reexec_count"] == 20 and st["control_server"]["last_reexec_at"]
    assert all(alive(pid) and _identity(pid) == ident for pid, ident in ((a[0], a) for a in agents.values()))
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
        assert _identity(agents[sid][0]) == agents[sid]


def test_scenario_d_hundred_reloads_at_random_moments(kandev_factory: Any) -> None:
    """Issue 15 scenario D: 100 reloads (SIGHUP to the server, as ExecReload= sends it) at random
    moments while the backend streams: floods in flight (mid-frame), the backend re-attaching after
    the previous reload (mid-attach), and three backend restarts whose adoption rotates the
    credential while reloads go on (mid-rotation). 0 agents lost, 0 events lost or duplicated,
    every reload re-executed."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    server_pid = int(st["control_server"]["pid"])
    socket_path = st["control_server"]["endpoint"]
    slow_sid = k.start_session("slow")[1]
    flood_sid = k.start_session("floods")[1]
    k.cli("prompt", slow_sid, "/slow 100000")  # streams all along; cancelled at the end
    agents = {sid: _identity(int(k.show(sid)["agent_pid"])) for sid in (slow_sid, flood_sid)}
    rng = random.Random(int(os.environ.get("KANDEV_TEST_SEED", "15")))
    stop = threading.Event()
    errors: list[BaseException] = []
    floods: list[str] = []

    def state(sid: str) -> str:  # from the store: the flood session's transcript outgrows one frame
        return db_row(k, "SELECT state FROM task_sessions WHERE id = ?", sid)["state"]

    def flood_turns() -> None:  # one /flood turn after another; the backend may be down meanwhile
        try:
            while not stop.is_set():
                try:
                    floods.append(k.cli("prompt", flood_sid, "/flood 400", "--wait", timeout=240)["turn_id"])
                    continue
                except CliError:  # the backend was restarted under the call, or is still starting
                    pass
                wait_until(lambda: state(flood_sid) == "WAITING_FOR_INPUT", timeout=240, interval=0.5)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    driver = threading.Thread(target=flood_turns, daemon=True)
    driver.start()
    restarts = {25, 50, 75}
    restarters: list[threading.Thread] = []
    count = 0
    try:
        for n in range(1, 101):
            if n in restarts:  # kill the backend and start another: it adopts (rotate, confirm) meanwhile
                backend = k.backend_pid
                os.kill(backend, signal.SIGKILL)
                wait_until(lambda backend=backend: not alive(backend), timeout=30)
                restarter = threading.Thread(target=k.up, daemon=True)
                restarter.start()
                restarters.append(restarter)
            time.sleep(rng.uniform(0.0, 0.5))
            before = read_status(socket_path)
            assert before is not None and before["pid"] == server_pid
            attempts = int(before["reload"]["attempts"])
            os.kill(server_pid, signal.SIGHUP)
            done = wait_until(lambda attempts=attempts: s if (s := read_status(socket_path)) and int(
                s["reload"]["last_attempt"]) > attempts and not s["reload"]["in_progress"] else None, timeout=120)
            assert done["reload"]["last_outcome"] == "reexecuted", done
            count = int(done["reload"]["reexec_count"])
            assert not errors, errors
        for restarter in restarters:
            restarter.join(120)
    finally:
        stop.set()
    driver.join(300)
    assert not errors, (errors, _problems(k))
    assert count == 100
    assert k.show(slow_sid)["live"], _problems(k)
    k.cli("cancel", slow_sid)
    for sid in (slow_sid, flood_sid):
        wait_until(lambda sid=sid: state(sid) == "WAITING_FOR_INPUT", timeout=120, interval=0.5)
    st = k.status()
    assert int(st["control_server"]["pid"]) == server_pid and st["control_server"]["reexec_count"] == 100
    assert st["adoption"]["outcome"] == "adopted"
    for sid, ident in agents.items():
        assert _identity(ident[0]) == ident, f"agent of session {sid} was lost"
    # the slow turn: a prefix of 1..N, each chunk once, in order
    slow_chunks = agent_chunks(k.show(slow_sid))
    assert slow_chunks == [f"{i}/100000 " for i in range(1, len(slow_chunks) + 1)] and slow_chunks
    # every flood turn: exactly its 400 chunks, in order, once (read from the store)
    by_turn: dict[str, list[str]] = {}
    for m in (m for m in k.transcript(flood_sid) if m["kind"] == "agent_message_chunk"):
        by_turn.setdefault(m["turn_id"], []).append(m["text"])
    assert len(floods) >= 3 and set(floods) <= set(by_turn)
    for turn_id, texts in by_turn.items():
        assert texts == [f"{i}/400 " for i in range(1, 401)], turn_id
    turns = db_rows(k, "SELECT state, stop_reason FROM turns WHERE session_id = ?", flood_sid)
    assert Counter((t["state"], t["stop_reason"]) for t in turns) == Counter({("finished", "end_turn"): len(turns)})
    assert len(turns) == len(by_turn)


def test_backend_asks_an_older_server_that_can_reload_to_reload(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 15 item 5: a backend that adopts a control server running an older version that can
    reload asks it to, once ready; the server re-executes the installed (newer) code in place and
    its agent keeps running. Here the older version is a copy of the tree whose daemon/version.py
    says 0.1.9; the "upgrade" replaces that file under the running server, as a package would."""
    code = short_tmp / "code"
    for top in ("daemon", "ipc"):
        shutil.copytree(REPO_ROOT / top, code / top, ignore=shutil.ignore_patterns("__pycache__"))
    version_py = code / "daemon" / "version.py"
    version_py.write_text(version_py.read_text().replace(f'VERSION = "{VERSION}"', 'VERSION = "0.1.9"'))
    old = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    old.env["PYTHONPATH"] = str(code)  # backend and control server of "0.1.9"
    old.cwd = short_tmp  # not the checkout: `python -m` would load the checkout's code first
    st = old.up()
    assert st["backend"]["version"] == "0.1.9" and st["control_server"]["version"] == "0.1.9"
    server = _identity(int(st["control_server"]["pid"]))
    _, sid = old.start_session("older")
    old.cli("prompt", sid, "/slow 15")
    show = wait_until(lambda: s if len(agent_chunks(s := old.show(sid))) >= 2 else None, timeout=60)
    agent = _identity(int(show["agent_pid"]))
    os.kill(int(st["backend"]["pid"]), signal.SIGKILL)
    wait_until(lambda: not alive(int(st["backend"]["pid"])), timeout=30)
    version_py.write_text(version_py.read_text().replace('VERSION = "0.1.9"', f'VERSION = "{VERSION}"'))

    new = Kandev(old.home, {**old.env, "PYTHONPATH": str(REPO_ROOT)})  # the current backend, same home
    new.backend_pids, new.server_pids, new.agent_pids = old.backend_pids, old.server_pids, old.agent_pids
    st = new.up()
    assert st["adoption"]["outcome"] == "adopted" and st["recovery"]["retracked"] == 1
    ctl = wait_until(lambda: c if (c := new.status()["control_server"])["version"] == VERSION else None, timeout=90)
    assert ctl["reexec_count"] == 1 and ctl["last_reload"]["outcome"] == "reexecuted"
    assert _identity(int(ctl["pid"])) == server and _identity(agent[0]) == agent
    log = (new.home / "logs" / "backend.log").read_text()
    assert "control_server_outdated" in log and "running_version=0.1.9" in log
    done = wait_until(lambda: s if (s := new.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)
    assert agent_chunks(done) == [f"{i}/15 " for i in range(1, 16)]
