"""Issue 15 scenario D: 100 reloads of the control server at random moments under a running backend
(no service manager): mid-frame, mid-attach and mid-rotation (the backend is restarted, so adopts
and rotates, while the reloads go on). Real daemons through the real CLI, agent survival on.

A module of its own (not test_reload_cli.py): the suite runs one module per worker, and the two
longest reload scenarios then run side by side.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from typing import Any

import pytest

from daemon.agentctl.reload.client import read_status
from tests.support.kandev import CliError, db_row, db_rows, logged_problems
from tests.support.processes import alive, identity
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(1500)  # 100 re-execs: two interpreter starts each (preflight, new image)


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
    agents = {sid: identity(int(k.show(sid)["agent_pid"])) for sid in (slow_sid, flood_sid)}
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
    if errors:  # printed whole (an assertion message is cut short): what each daemon logged, and where the sessions are
        print(logged_problems(k))
        print({sid: db_row(k, "SELECT state, last_error FROM task_sessions WHERE id = ?", sid) for sid in (slow_sid, flood_sid)})
        print(db_rows(k, "SELECT id, state, stop_reason FROM turns WHERE session_id = ?", flood_sid)[-3:])
    assert not errors, errors
    assert count == 100
    assert k.show(slow_sid)["live"], logged_problems(k)
    k.cli("cancel", slow_sid)
    for sid in (slow_sid, flood_sid):
        wait_until(lambda sid=sid: state(sid) == "WAITING_FOR_INPUT", timeout=120, interval=0.5)
    st = k.status()
    assert int(st["control_server"]["pid"]) == server_pid and st["control_server"]["reexec_count"] == 100
    assert st["adoption"]["outcome"] == "adopted"
    for sid, ident in agents.items():
        assert identity(ident[0]) == ident, f"agent of session {sid} was lost"
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
