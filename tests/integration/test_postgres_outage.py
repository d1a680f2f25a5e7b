"""The store's PostgreSQL goes away while a turn streams, and comes back (Issue 47 item 5;
Issue 47 scenario C on one host): real backend, control server, mock agent and a PostgreSQL
server of the test's own, stopped and started with ``pg_ctl`` mid-``/flood 20000`` (or its
connections ended with ``pg_terminate_backend``).

Throughout: the backend never exits (same pid), the agent keeps running, the control server keeps
the events the backend cannot store, and once the database is back every one of the 20,000 chunks
is in the transcript once and in order and the turn ends exactly once. While the server is down,
``kandev status`` (human and ``--json``: ``store.reachable`` false, ``store.unreachable_since``)
says the store is unreachable, the journal says ``store_unreachable`` once and ``store_reachable``
once it is back, and an operation that needs the store is refused with ``store_unreachable`` (not
a hang, not an internal error).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.kandev import CliError, Kandev
from tests.support.postgres import PgCluster
from tests.support.postgres import require as postgres_bin
from tests.support.processes import alive
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

N = 20_000


@pytest.fixture
def own_postgres() -> Iterator[PgCluster]:
    """A PostgreSQL server of this test alone (it is stopped and started mid-test)."""
    cluster = PgCluster(postgres_bin()).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _dbname(url: str) -> str:
    return url.split("@/", 1)[1].split("?", 1)[0]


def _stored_cursor(pg: PgCluster, db: str) -> int:
    """Transcript cursors handed out so far (the prompt's entry, then one per chunk); -1 while the
    server is down."""
    try:
        rows = pg.query(db, "SELECT coalesce(max(last_cursor), 0) FROM transcript_sessions")
    except Exception:
        return -1
    return int(rows[0][0])  # type: ignore[call-overload]


def _logged(k: Kandev, event: str) -> int:
    """How many times the backend's journal (its log file here) recorded ``event``."""
    log = k.home / "logs" / "backend.log"
    return sum(f" {event} " in line for line in log.read_text(errors="replace").splitlines()) if log.exists() else 0


def _flooding(kandev_factory: Any, pg: PgCluster) -> tuple[Kandev, str, str, int, int]:
    url = pg.new_database()
    k = kandev_factory("home", f'[database]\nurl = "{url}"\n[features]\nagent_survival = true\n')
    backend = int(k.up()["backend"]["pid"])
    _, sid = k.start_session("flood")
    k.cli("prompt", sid, f"/flood {N}")
    db = _dbname(url)
    wait_until(lambda: _stored_cursor(pg, db) > 2_000, timeout=120, message="the flood never started")
    agent = int(k.show(sid)["agent_pid"])
    return k, sid, db, backend, agent


def _waiting_for_input(k: Kandev, sid: str) -> dict[str, Any] | None:
    """The session once its turn is over; None before, and while a short episode of an unreachable
    store refuses the call (a dropped connection: retryable, as a script would retry)."""
    try:
        show = k.show(sid)
    except CliError as exc:
        if json.loads(exc.stdout)["error"]["code"] == "store_unreachable":
            return None
        raise
    return show if show["state"] == "WAITING_FOR_INPUT" else None


def _finishes_whole(k: Kandev, sid: str, backend: int, agent: int) -> None:
    done = wait_until(lambda: _waiting_for_input(k, sid), timeout=300, interval=0.5,
                      message="the turn never completed once the database was back")
    assert [(t["state"], t["stop_reason"]) for t in done["turns"]] == [("finished", "end_turn")]
    chunks = [e["text"] for e in k.transcript(sid) if e["kind"] == "agent_message_chunk"]
    assert len(chunks) == N and chunks == [f"{i}/{N} " for i in range(1, N + 1)]
    assert int(k.status()["backend"]["pid"]) == backend
    assert alive(agent) and int(k.show(sid)["agent_pid"]) == agent


def _store_lock_held(pg: PgCluster, db: str) -> bool:
    """Whether a connection to ``db`` holds an advisory lock (the backend's store lock)."""
    rows = pg.query(db, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                        " WHERE l.locktype = 'advisory' AND l.granted AND a.datname = %s", db)
    return int(rows[0][0]) == 1  # type: ignore[call-overload]


def _store(k: Kandev) -> dict[str, Any]:
    store: dict[str, Any] = k.status()["store"]
    return store


def test_scenario_c_postgresql_restarts_mid_flood(kandev_factory: Any, own_postgres: PgCluster) -> None:
    """Issue 47 scenario C, Issue 47 item 5: PostgreSQL stops during ``/flood 20000`` and starts
    again; status says the store is unreachable meanwhile, other calls get ``store_unreachable``;
    every chunk once and in order, the turn ends once, same backend, same agent."""
    pg = own_postgres
    k, sid, db, backend, agent = _flooding(kandev_factory, pg)
    assert _store(k)["reachable"] is True
    follow = k.popen("follow", sid, json_output=True)  # open through the outage: it pauses, then goes on
    assert follow.stdout is not None
    first = json.loads(follow.stdout.readline())  # the stream is open (the flood is under way: at once)
    assert _stored_cursor(pg, db) <= N  # the turn is mid-flood (its last chunk is cursor N + 1)
    pg.stop_server()
    # status says so at once (it asks the server), the journal once, and the backend keeps trying
    gone = wait_until(lambda: s if (s := _store(k))["reachable"] is False else None, timeout=15,
                      message="status never said the store is unreachable")
    assert isinstance(gone["unreachable_since"], float) and gone["unreachable"]["detail"], gone
    # six failed probes: the delay reached its 2 s bound, seconds of outage while the agent floods
    wait_until(lambda: _store(k)["unreachable"]["attempts"] >= 6, timeout=60, message="no reconnection attempts")
    assert _logged(k, "store_unreachable") == 1
    human = k.human("status")
    assert human.returncode == 0 and "store unreachable since" in human.stdout, human.stdout
    refused = k.run("board")
    assert refused.returncode != 0 and json.loads(refused.stdout)["error"]["code"] == "store_unreachable", refused
    prompt = k.run("prompt", sid, "again")
    assert json.loads(prompt.stdout)["error"]["code"] == "store_unreachable", prompt
    shown = k.human("session", "show", sid)
    assert shown.returncode != 0 and "database server (database.url) is unreachable" in shown.stderr, shown
    assert alive(agent) and int(k.status()["backend"]["pid"]) == backend

    pg.start_server()
    wait_until(lambda: _store(k)["reachable"], timeout=30, message="the store never became reachable again")
    assert _logged(k, "store_reachable") == 1
    _finishes_whole(k, sid, backend, agent)
    assert _logged(k, "store_unreachable") == 1
    out = follow.stdout.read()  # to its end: the stream ends after the turn's end
    assert follow.wait(timeout=60) == 0, follow.stderr.read() if follow.stderr else ""
    events = [first] + [json.loads(line) for line in out.decode().splitlines()]
    streamed = "".join(e["data"]["text"] for e in events
                       if e["kind"] == "entry" and e["data"]["kind"] == "agent_message_chunk")
    assert streamed == "".join(f"{i}/{N} " for i in range(1, N + 1))
    assert [e["kind"] for e in events].count("turn_ended") == 1 and events[-1]["kind"] == "turn_ended", events[-3:]
    # the restart dropped the store's advisory lock with its connection: held again
    wait_until(lambda: _store_lock_held(pg, db), timeout=30, message="the backend did not take the store's lock again")


def test_dropped_connections_mid_flood(kandev_factory: Any, own_postgres: PgCluster) -> None:
    """Issue 47 item 5: every connection of the backend to its database is ended
    (``pg_terminate_backend``) during ``/flood 20000``, twice: every chunk once and in order, and
    the backend holds the store's lock again afterwards."""
    pg = own_postgres
    k, sid, db, backend, agent = _flooding(kandev_factory, pg)
    assert pg.terminate(db) >= 2  # the store's pool and the store lock's connection
    wait_until(lambda: _store_lock_held(pg, db), timeout=30, message="the backend did not take the store's lock again")
    pg.terminate(db)  # again, whatever the flood has reached by now
    _finishes_whole(k, sid, backend, agent)
    assert _logged(k, "store_unreachable") == _logged(k, "store_reachable")
    assert _store(k)["reachable"] is True
    wait_until(lambda: _store_lock_held(pg, db), timeout=30, message="the backend did not take the store's lock again")


def test_a_backend_started_while_postgresql_is_down_waits_for_it(kandev_factory: Any,
                                                                   own_postgres: PgCluster) -> None:
    """Issue 47 item 5 (a backend that starts while its database server is down): it waits for
    the server, serving ``status``, instead of exiting (under systemd: a restart every second,
    each an error). ``up`` returns with status saying the store is unreachable and why; other
    calls get the retryable ``store_unreachable``; ``down`` stops the waiting backend; once the
    server is back the start goes on by itself (same pid) and a session runs a turn."""
    pg = own_postgres
    url = pg.new_database()
    k = kandev_factory("home", f'[database]\nurl = "{url}"\n')
    pg.stop_server()

    first = k.cli("up", timeout=120)["status"]  # waiting, not exited
    k.backend_pids.add(int(first["backend"]["pid"]))
    assert first["backend"]["state"] == "store_unreachable" and first["store"]["reachable"] is False, first
    assert first["store"]["unreachable"]["detail"], first
    k.cli("down", timeout=60)  # a stop while waiting: a clean exit, the socket gone
    wait_until(lambda: not alive(int(first["backend"]["pid"])), timeout=30, message="the waiting backend never exited")
    assert not (k.home / "run" / "backend.sock").exists()

    st = k.cli("up", timeout=120)["status"]
    backend = int(st["backend"]["pid"])
    k.backend_pids.add(backend)
    assert st["backend"]["state"] == "store_unreachable", st
    wait_until(lambda: k.status()["store"]["unreachable"]["attempts"] >= 2, timeout=30,
               message="no attempts to reach the server again")
    human = k.human("status")
    assert "store unreachable since" in human.stdout and "store_unreachable" in human.stdout, human.stdout
    refused = k.run("board")
    error = json.loads(refused.stdout)["error"]
    assert refused.returncode != 0 and error["code"] == "store_unreachable" and error["retryable"], error
    assert _logged(k, "store_unreachable") == 2  # once per start

    pg.start_server()
    ready = wait_until(lambda: s if (s := k.status())["backend"]["state"] == "ready" else None, timeout=60,
                       message="the backend never went on once the server was back")
    assert int(ready["backend"]["pid"]) == backend and ready["store"]["reachable"] is True
    assert _logged(k, "store_reachable") == 1
    _, sid = k.start_session("after the wait")
    k.cli("prompt", sid, "/slow 2")
    done = wait_until(lambda: _waiting_for_input(k, sid), timeout=60, message="the turn never completed")
    assert [(t["state"], t["stop_reason"]) for t in done["turns"]] == [("finished", "end_turn")]
