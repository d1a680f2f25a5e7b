"""daemon.store.reach and the store upkeep's reconnection: a database server that cannot be reached
is recognised (and nothing else is), reported once per episode, retried at once and then with a
growing delay, and the episode ends with the first probe that commits; idle pooled connections the
server ended are replaced; a follow round it failed is read again (Issue 47 item 5)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from typing import Any

import psycopg
import psycopg.errors
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError

from daemon.backend.lifetime import store_care
from daemon.backend.lifetime.store_care import StoreCare
from daemon.backend.state.executions import ExecutionStore
from daemon.backend.state.transcript_hub import TranscriptHub
from daemon.backend.views.follow import FollowService, Position, Round
from daemon.store import db as db_module
from daemon.store import reach
from daemon.store.db import Store, engine_options
from daemon.store.reach import MAX_RETRY_S, ReachWatch, is_unreachable, next_delay
from tests.support.aio import run
from tests.support.postgres import PgCluster


def _wrapped(orig: Exception, invalidated: bool = False) -> OperationalError:
    return OperationalError("INSERT ...", {}, orig, connection_invalidated=invalidated)


def _events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, Any]]]:
    return [(r.kandev_event, r.kandev_fields) for r in caplog.records if hasattr(r, "kandev_event")]


def test_what_counts_as_unreachable() -> None:
    # the server cannot be connected to, or ended the connection, or shuts down / starts up
    assert is_unreachable(_wrapped(psycopg.OperationalError("connection is bad: No such file or directory")))
    assert is_unreachable(_wrapped(psycopg.errors.AdminShutdown("terminating connection")))
    assert is_unreachable(_wrapped(psycopg.errors.CannotConnectNow("the database system is starting up")))
    assert is_unreachable(psycopg.errors.ConnectionFailure("08006"))
    assert is_unreachable(_wrapped(RuntimeError("whatever the driver said"), invalidated=True))
    assert is_unreachable(psycopg.InterfaceError("the connection is closed"))
    # everything else is not about reaching the server: an SQLite error, a constraint, a full disk
    assert not is_unreachable(_wrapped(sqlite3.OperationalError("database is locked")))  # type: ignore[arg-type]
    assert not is_unreachable(IntegrityError("INSERT ...", {}, psycopg.errors.UniqueViolation("duplicate key")))
    assert not is_unreachable(_wrapped(psycopg.errors.DiskFull("could not extend file")))
    assert not is_unreachable(ValueError("bad input"))


def test_a_connection_the_server_refused_is_not_waited_for() -> None:
    """Issue 47 item 5, Issue 47 item 6: a backend that starts while its database server is down
    waits for it, but a connection the server answered and refused (as psycopg reports them: no
    SQLSTATE, like an outage) is a configuration to correct: its start fails saying why."""
    sock = 'connection failed: connection to server on socket "/run/pg/.s.PGSQL.5432" failed: '
    for refused in ('FATAL:  password authentication failed for user "kdx"', "fe_sendauth: no password supplied",
                    'FATAL:  role "nosuchrole" does not exist', 'FATAL:  database "kd" does not exist',
                    'FATAL:  no pg_hba.conf entry for host "10.0.0.5", user "kandev", database "kandev"'):
        assert reach.refused_connection(_wrapped(psycopg.OperationalError(sock + refused))), refused
    for outage in ("No such file or directory", "Connection refused", "FATAL:  the database system is starting up",
                   "timeout expired"):
        assert not reach.refused_connection(_wrapped(psycopg.OperationalError(sock + outage))), outage


def test_retries_at_once_then_back_off_to_a_bound() -> None:
    assert next_delay(0) == 0.0
    delays = [next_delay(n) for n in range(1, 10)]
    assert 0.2 <= delays[0] <= 0.3 and 0.4 <= delays[1] <= 0.6
    assert all(d <= MAX_RETRY_S * 1.2 for d in delays) and delays[-1] >= MAX_RETRY_S * 0.8


def test_an_episode_is_reported_once_and_ends_with_a_success(caplog: pytest.LogCaptureFixture) -> None:
    watch = ReachWatch()
    caplog.set_level(logging.INFO)
    assert watch.status() == {"reachable": True, "unreachable_since": None, "unreachable": None}
    assert not watch.failed(ValueError("not about the server"))
    gone = _wrapped(psycopg.errors.AdminShutdown("terminating connection due to administrator command"))
    assert watch.failed(gone) and watch.failed(gone) and watch.unreachable
    status = watch.status()
    assert status["reachable"] is False and status["unreachable_since"] == status["unreachable"]["since"]
    assert "AdminShutdown" in status["unreachable"]["detail"]
    assert [e for e, _ in _events(caplog)] == ["store_unreachable"]

    async def woken() -> None:
        waiter = asyncio.get_running_loop().create_task(watch.wait_reachable())
        await asyncio.sleep(0)  # it waits
        watch.succeeded()
        await waiter

    run(woken(), timeout=10)
    assert not watch.unreachable and watch.status()["reachable"] is True and watch.episodes == 1
    assert [e for e, _ in _events(caplog)] == ["store_unreachable", "store_reachable"]
    run(watch.wait_reachable(), timeout=10)  # no episode: at once


def test_the_upkeep_reconnects_with_backoff_and_takes_the_lock_again(
        store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """While unreachable only the upkeep tries the store: probes fail twice (counted), the third
    commits, the store lock is taken again before the episode ends."""
    care = StoreCare(store, None)
    relocked: list[bool] = []

    def keep_lock() -> bool:
        relocked.append(care.reach.unreachable)  # before the episode ends
        return True  # it had to be taken again

    care.keep_lock = keep_lock
    real = store_care.probe_write
    failures = [_wrapped(psycopg.OperationalError("connection is bad"))] * 2

    def probe(s: Store, **kw: Any) -> bool:
        if failures:
            raise failures.pop()
        return real(s, **kw)

    monkeypatch.setattr(store_care, "probe_write", probe)
    caplog.set_level(logging.INFO)
    care.reach.failed(_wrapped(psycopg.OperationalError("connection is bad")))
    run(care._reconnect(), timeout=30)
    assert not care.reach.unreachable and relocked == [True]
    events = _events(caplog)
    assert [e for e, _ in events] == ["store_unreachable", "store_lock_retaken", "store_reachable"]
    assert events[-1][1]["ATTEMPTS"] == "2"


def test_postgresql_engines_time_out_sqlite_unchanged() -> None:
    pg = engine_options(make_url("postgresql+psycopg://kandev@/db?host=/run/pg"))
    assert pg["connect_args"]["connect_timeout"] == 5 and pg["connect_args"]["keepalives"] == 1
    assert engine_options(make_url("postgresql+psycopg://k@/db?connect_timeout=30"))["connect_args"].get(
        "connect_timeout") is None  # the URL's own value stands
    assert engine_options(make_url("sqlite:////var/lib/kandev/kandev.db")) == {}
    assert reach.WHERE == "database.url"


def test_a_pooled_connection_the_server_ended_is_replaced(postgres: PgCluster,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection ended while it sat idle in the pool (``pg_terminate_backend``) is checked and
    replaced when handed out, so the next call works; one used less than ``PING_IDLE_S`` ago is
    handed out unchecked (a flood's batches cost no extra round trip)."""
    url = postgres.new_database()
    store = Store.open(url)
    pings: list[int] = []
    real_ping = store.engine.dialect.do_ping

    def counted(conn: Any) -> bool:
        pings.append(1)
        return bool(real_ping(conn))

    monkeypatch.setattr(store.engine.dialect, "do_ping", counted)
    try:
        for _ in range(20):  # back to back: checked once at most (a connection handed out first)
            with store.session() as db:
                db.execute(text("SELECT 1"))
        assert len(pings) <= 1
        dbname = url.split("@/", 1)[1].split("?", 1)[0]
        assert postgres.terminate(dbname) >= 1
        monkeypatch.setattr(db_module, "PING_IDLE_S", 0.0)  # as after a second in the pool
        with store.session() as db:
            assert db.execute(text("SELECT 1")).scalar() == 1
    finally:
        store.close()


def test_a_follow_round_the_server_failed_is_read_again_from_where_it_started(store: Store) -> None:
    """A follow round moves its position as it reads; when the round then fails (its commit, on a
    connection the server ended), the stream waits for the server and reads that round again from
    the position it had, so no entry is skipped."""
    watch = ReachWatch()
    follow = FollowService(store, TranscriptHub(), ExecutionStore(), reach=watch)
    pos = Position(session_id="s", cursor=10, turn_id="t", follow_all=False)

    def failing_round(p: Position, live: bool, replaying: frozenset[str]) -> Round:
        p.cursor, p.turn_end_sent = 510, True  # read up to here, then the commit failed
        raise _wrapped(psycopg.errors.AdminShutdown("terminating connection"))

    follow._round = failing_round  # type: ignore[method-assign]

    async def scenario() -> Round | None:
        waiting = asyncio.get_running_loop().create_task(follow._next_round(pos, True, frozenset()))
        while not watch.unreachable:
            await asyncio.sleep(0.01)
        watch.succeeded()
        return await waiting

    assert run(scenario(), timeout=10) is None  # no round: read it again
    assert (pos.cursor, pos.turn_end_sent) == (10, False)
