"""The cluster's part of the store (Issue 47): migration 0007 upgrades an existing single-host store
(SQLite and PostgreSQL) keeping its control-server record and sessions; the control-server record is
one per host; a host's claim, heartbeat and reachability (daemon/backend/cluster/membership.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config as AlembicConfig
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.backend.cluster.identity import ClusterIdentity
from daemon.backend.cluster.membership import Cluster, HostDirectory, HostForeign
from daemon.backend.cluster.own_sessions import own_sessions_only, refusal
from daemon.store.db import MIGRATIONS_DIR, Store, sqlite_url
from daemon.store.models import ClusterHost, ControlServerRecord, Task, TaskSession
from ipc.errors import IpcError


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "kandev.db")
    url: str = request.getfixturevalue("postgres").new_database()
    return url


def test_migration_0007_upgrades_an_existing_single_host_store(empty_url: str) -> None:
    """Issue 47 scenario E: a store at revision 0006 with a control-server record and a session is
    upgraded by the backend's own open: the record is the single host's (host "", id 1), the
    session has no host, and the cluster's table is there, on SQLite and on PostgreSQL."""
    engine = create_engine(empty_url)
    with engine.begin() as conn:
        cfg = AlembicConfig()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0006")
        now = datetime(2026, 1, 1)
        conn.execute(text("INSERT INTO tasks (id, title, executor, state, interrupted, created_at, updated_at)"
                          " VALUES ('t', 't', 'local', 'backlog', false, :n, :n)"), {"n": now})
        conn.execute(text("INSERT INTO task_sessions (id, task_id, agent, state, metadata_json, passthrough,"
                          " created_at, updated_at) VALUES ('s', 't', 'mock', 'RUNNING', '{}', false, :n, :n)"),
                     {"n": now})
        conn.execute(text("INSERT INTO control_server_record (id, endpoint, server_identity, credential_ref,"
                          " capabilities, launch_mode, updated_at) VALUES (1, '/run/a.sock', 'ident', 'cred',"
                          " '[\"survival\"]', 'detached', :n)"), {"n": now})
    engine.dispose()
    store = Store.open(empty_url)
    try:
        with store.session() as db:
            rec = ClusterIdentity().record(db)
            assert rec is not None and (rec.id, rec.host, rec.endpoint) == (1, "", "/run/a.sock")
            assert rec.capabilities == ["survival"]
            assert db.get(TaskSession, "s").host is None
            assert db.query(ClusterHost).count() == 0
        with pytest.raises(IntegrityError), store.session() as db:  # still one row for the single host
            db.add(ControlServerRecord(id=2, endpoint="x", server_identity="i", credential_ref="c",
                                       capabilities=[], launch_mode="detached"))
    finally:
        store.close()


def _fill(rec: ControlServerRecord, endpoint: str) -> None:
    rec.endpoint, rec.server_identity, rec.credential_ref = endpoint, "ident", "cred"
    rec.capabilities, rec.launch_mode = [], "detached"


def test_each_host_has_its_own_control_server_record(any_store: Store) -> None:
    """Issue 47 item 1: the record is per host: host a's and b's side by side, each found by its host."""
    a, b = ClusterIdentity("a"), ClusterIdentity("b")
    for ident in (a, b, ClusterIdentity()):
        with any_store.session() as db:
            _fill(ident.new_record(db), f"/run/{ident.record_key or 'single'}.sock")
    with any_store.session() as db:
        assert [ident.record(db).endpoint for ident in (a, b, ClusterIdentity())] == [  # type: ignore[union-attr]
            "/run/a.sock", "/run/b.sock", "/run/single.sock"]
    with pytest.raises(IntegrityError), any_store.session() as db:  # a second record of host a
        db.add(ControlServerRecord(id=99, host="a", endpoint="x", server_identity="i", credential_ref="c",
                                   capabilities=[], launch_mode="detached"))


class Clock:
    """The database clock, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)

    def __call__(self, db: Session) -> datetime:
        return self.now


def test_claim_heartbeat_and_reachability(any_store: Store) -> None:
    """Issue 47 item 4: a claimed host is ready; without a heartbeat for host_timeout_s it is
    unreachable since its last heartbeat plus the timeout; a heartbeat makes it ready again; a clean
    stop shows it stopped; a name of another installation is refused naming it."""
    clock = Clock()
    a = HostDirectory(any_store, ClusterIdentity("a"), "inst-a", heartbeat_s=5, host_timeout_s=30, version="1",
                      machine="m-a", clock=clock)
    a.claim()
    assert a.reachability("a").state == "ready"  # type: ignore[union-attr]
    assert a.reachability("b") is None
    clock.now += timedelta(seconds=30)
    assert a.reachability("a").state == "ready"  # type: ignore[union-attr]
    clock.now += timedelta(seconds=1)
    seen = a.reachability("a")
    assert seen is not None and seen.state == "unreachable" and not seen.live
    assert seen.since == datetime(2026, 12, 6, 12, 0, 30, tzinfo=UTC) and seen.machine == "m-a"
    a.heartbeat()
    assert [(h.name, h.state) for h in a.hosts()] == [("a", "ready")]
    a.stop()
    assert a.reachability("a").state == "stopped"  # type: ignore[union-attr]
    other = HostDirectory(any_store, ClusterIdentity("a"), "inst-z", heartbeat_s=5, host_timeout_s=30, version="1",
                          machine="m-z", clock=clock)
    with pytest.raises(HostForeign, match="inst-a"):
        other.claim()


def test_host_counts(any_store: Store) -> None:
    """kandev hosts' SESSIONS column: the sessions recorded with each host."""
    with any_store.session() as db:
        db.add(Task(id="t", title="t"))
        db.flush()
        db.add_all([TaskSession(task_id="t", agent="mock", host=h) for h in ("a", "a", "b", None)])
    with any_store.session() as db:
        counts = HostDirectory.counts(db)
    assert (counts["a"].sessions, counts["b"].sessions, counts[None].sessions) == (2, 1, 1)


def test_another_hosts_session_is_never_driven_here(any_store: Store) -> None:
    """Issue 47 item 1, Issue 47 item 6: the ops that drive an agent are refused on another host's
    session, before any handler runs: host_unreachable (naming the host and since when) while it is
    not ready, other_host while it is; this host's own sessions pass."""
    clock = Clock()
    kwargs: dict[str, Any] = dict(heartbeat_s=5, host_timeout_s=30, version="1", clock=clock)
    b = HostDirectory(any_store, ClusterIdentity("b"), "inst-b", machine="m-b", **kwargs)
    b.claim()
    a = Cluster(ClusterIdentity("a"), HostDirectory(any_store, ClusterIdentity("a"), "inst-a", **kwargs))
    with any_store.session() as db:
        db.add(Task(id="t", title="t"))
        db.flush()
        db.add_all([TaskSession(id="on-a", task_id="t", agent="mock", host="a"),
                    TaskSession(id="on-b", task_id="t", agent="mock", host="b")])
    assert refusal(a, any_store, "on-a") is None and refusal(a, any_store, "missing") is None
    other = refusal(a, any_store, "on-b")
    assert other is not None and other.code == "other_host" and "cluster host b" in other.message
    clock.now += timedelta(seconds=31)
    gone = refusal(a, any_store, "on-b")
    assert gone is not None and gone.code == "host_unreachable" and gone.retryable
    assert "cluster host b, which is unreachable since 2026-12-06T12:00:30+00:00" in gone.message

    called: list[str] = []

    async def handler(ctx: Any, args: dict[str, Any]) -> str:
        called.append(args["session_id"])
        return "ran"

    table = own_sessions_only(a, any_store, {"prompt": handler, "session_show": handler})
    assert asyncio.run(table["session_show"](None, {"session_id": "on-b"})) == "ran"  # reading is fine
    with pytest.raises(IpcError, match="host_unreachable|cluster host b"):
        asyncio.run(table["prompt"](None, {"session_id": "on-b"}))
    assert asyncio.run(table["prompt"](None, {"session_id": "on-a"})) == "ran" and called == ["on-b", "on-a"]
    single = Cluster(ClusterIdentity(), a.directory)
    assert own_sessions_only(single, any_store, {"prompt": handler})["prompt"] is handler
