"""The backend on PostgreSQL (``database.url``) with a real server: the main job works the same.

A task's agent survives a backend SIGKILL and is re-tracked, with every chunk once and in order,
and all of it lives in the PostgreSQL database (no SQLite file appears in the home).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, text

from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def test_survival_round_trip_on_postgresql(kandev_factory, postgres):
    url = postgres.new_database()
    k = kandev_factory("home", f'[database]\nurl = "{url}"\n[features]\nagent_survival = true\n')
    st = k.up()
    task, sid = k.start_session("pg")
    k.cli("prompt", sid, "hello", "--wait")
    assert agent_chunks(k.show(sid)) == ["echo: hello"]
    k.cli("prompt", sid, "/slow 8")
    show = wait_until(lambda: s if agent_chunks(s := k.show(sid))[1:] else None, timeout=30)
    pid, backend = show["agent_pid"], st["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)

    st2 = k.up()
    assert st2["adoption"]["outcome"] == "adopted" and st2["recovery"]["retracked"] == 1
    assert k.show(sid)["retracked"] and alive(pid)
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=60)
    assert agent_chunks(done) == ["echo: hello"] + [f"{i}/8 " for i in range(1, 9)]

    assert not (k.home / "kandev.db").exists()
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            state = conn.execute(text("SELECT state FROM task_sessions WHERE id = :id"), {"id": sid}).scalar()
            chunks = conn.execute(text(
                "SELECT sum(e.last_cursor - e.cursor + 1) FROM transcript_entries e JOIN transcript_sessions s"
                " ON s.key = e.session_key WHERE s.session_id = :id AND e.kind = 'agent_message_chunk'"),
                {"id": sid}).scalar()
            row = conn.execute(text("SELECT status, resume_token FROM executors_running WHERE session_id = :id"),
                               {"id": sid}).one()
    finally:
        engine.dispose()
    assert state == "WAITING_FOR_INPUT" and chunks == 9
    assert row.status == "live" and row.resume_token == done["resume_token"]
    assert task in k.cli("board")["turn_finished"]

    # kandev doctor reads the same store through database.url
    doctor = json.loads(k.run("doctor").stdout)
    store = next(c for c in doctor["checks"] if c["name"] == "store")
    assert store["ok"] and "database.url" in store["detail"] and "(head)" in store["detail"], store
    assert url not in store["detail"]  # the URL (it may hold a password) is not echoed


def test_one_postgresql_database_serves_one_home(kandev_factory, postgres):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.4 for a PostgreSQL store: a second backend (another home)
    on the same database is refused at start, before it logs; once the first is gone it is still
    refused, because the store belongs to the first installation (Issue 10 item 5)."""
    url = postgres.new_database()
    first = kandev_factory("one", f'[database]\nurl = "{url}"\n')
    st = first.up()
    second = kandev_factory("two", f'[database]\nurl = "{url}"\n')
    proc = subprocess.run([sys.executable, "-m", "daemon.backend.main", "--home", str(second.home)],
                          capture_output=True, text=True, env=second.env, timeout=60, cwd=REPO_ROOT)
    assert proc.returncode == 1 and "already uses this PostgreSQL database" in proc.stderr, proc.stderr
    assert not (second.home / "logs" / "backend.log").exists()
    assert first.status()["backend"]["pid"] == st["backend"]["pid"]
    os.kill(st["backend"]["pid"], signal.SIGKILL)  # the server drops the lock with the connection
    wait_until(lambda: not alive(st["backend"]["pid"]), timeout=10)

    def refused_as_foreign() -> str | None:
        proc = subprocess.run([sys.executable, "-m", "daemon.backend.main", "--home", str(second.home)],
                              capture_output=True, text=True, env=second.env, timeout=60, cwd=REPO_ROOT)
        assert proc.returncode == 1, proc.stderr
        return proc.stderr if "belongs to installation" in proc.stderr else None

    stderr = wait_until(refused_as_foreign, timeout=60)
    first_id = (first.home / "installation-id").read_text().strip()
    assert first_id in stderr and (second.home / "installation-id").read_text().strip() in stderr
    assert first.up()["backend"]["state"] == "ready"  # its own installation drives it again
