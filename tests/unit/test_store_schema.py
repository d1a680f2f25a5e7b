"""daemon.store: migrations from empty, schema equals the models, SQLite settings, constraints."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config as AlembicConfig
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from daemon.store.db import MIGRATIONS_DIR, Store, sqlite_url
from daemon.store.models import Base, ControlServerRecord, Task, TaskSession


def _head() -> str:
    """The one head revision of the shipped migrations (a second head would be a broken chain)."""
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    heads = ScriptDirectory.from_config(cfg).get_heads()
    assert len(heads) == 1, f"migrations have several heads: {heads}"
    return heads[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty database on each engine kandev supports (PostgreSQL: a real server)."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "kandev.db")
    url: str = request.getfixturevalue("postgres").new_database()
    return url


@pytest.mark.parametrize("empty_at_head", [False, True], ids=["by the migrations", "created at head"])
def test_store_migrates_from_empty(tmp_path: Path, empty_at_head: bool) -> None:
    """A new store, built by the migrations or created at head (what a new home's start does):
    every table, the newest revision recorded, the file 0600; reopening is a no-op upgrade."""
    store = Store.open(sqlite_url(tmp_path / "kandev.db"), empty_at_head=empty_at_head)
    tables = set(inspect(store.engine).get_table_names())
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == _head()
    assert stat.S_IMODE(os.stat(tmp_path / "kandev.db").st_mode) == 0o600
    store.close()
    Store.open(sqlite_url(tmp_path / "kandev.db")).close()


def test_store_schema_matches_models(store_url: str) -> None:
    """The migrations build exactly the models' schema, on SQLite and on PostgreSQL."""
    store = Store.open(store_url, empty_at_head=False)
    try:
        with store.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        store.close()
    assert diff == []


def _schema(store: Store) -> dict[str, object]:
    """Everything the inspector reports of every table, constraints included, order aside."""
    def norm(items: list[Any]) -> list[str]:
        return sorted(repr(sorted(i.items()) if isinstance(i, dict) else i) for i in items)

    insp = inspect(store.engine)
    out: dict[str, object] = {}
    for table in sorted(insp.get_table_names()):
        out[table] = {
            "columns": norm([{**c, "type": str(c["type"])} for c in insp.get_columns(table)]),
            "pk": insp.get_pk_constraint(table),
            "fks": norm(insp.get_foreign_keys(table)),
            "indexes": norm(insp.get_indexes(table)),
            "uniques": norm(insp.get_unique_constraints(table)),
            "checks": norm([{"name": c["name"], "sqltext": " ".join(str(c["sqltext"]).split())}
                            for c in insp.get_check_constraints(table)]),
        }
    return out


def test_a_store_created_at_head_is_the_migrated_store(store_url: str, request: pytest.FixtureRequest) -> None:
    """A new home's store is created at head without replaying the migrations; it is the same
    schema the migrations build, to the check constraint, on SQLite and on PostgreSQL."""
    if store_url.startswith("sqlite"):
        other = sqlite_url(Path(store_url.split("///", 1)[1]).with_name("migrated.db"))
    else:
        other = request.getfixturevalue("postgres").new_database()
    created, migrated = Store.open(store_url), Store.open(other, empty_at_head=False)
    try:
        assert _schema(created) == _schema(migrated)
        assert _schema(created)["tasks"]["checks"]  # type: ignore[index]  # the comparison sees constraints
    finally:
        created.close()
        migrated.close()


def test_store_sqlite_pragmas(store: Store) -> None:
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 5000


def test_store_session_commits_or_rolls_back(store: Store) -> None:
    with pytest.raises(RuntimeError), store.session() as db:
        db.add(Task(title="lost"))
        db.flush()
        raise RuntimeError
    with store.session() as db:
        db.add(Task(title="kept"))
    with store.session() as db:
        assert [t.title for t in db.query(Task)] == ["kept"]
        task = db.query(Task).one()
        assert task.created_at.tzinfo is not None and task.interrupted is False


def _record(**kw: object) -> ControlServerRecord:
    values: dict[str, object] = dict(endpoint="/run/a.sock", server_identity="id", credential_ref="agentctl-cred-1",
                                     capabilities=["survival"], launch_mode="detached")
    values.update(kw)
    return ControlServerRecord(**values)


def test_store_control_server_record_single_row(store: Store) -> None:
    with store.session() as db:
        db.add(_record())
    with store.session() as db:
        rec = db.get(ControlServerRecord, 1)
        assert rec is not None and rec.capabilities == ["survival"]
    with pytest.raises(IntegrityError), store.session() as db:
        db.add(_record(id=2))
    with pytest.raises(IntegrityError), store.session() as db:
        db.add(_record(launch_mode="other"))


def test_store_foreign_keys_enforced(store: Store) -> None:
    with pytest.raises(IntegrityError), store.session() as db:
        db.add(TaskSession(task_id="missing", agent="mock"))


def test_store_state_check_constraint(store: Store) -> None:
    with pytest.raises(IntegrityError), store.session() as db:
        db.add(Task(title="t", state="limbo"))


def test_store_migration_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration that fails part-way leaves no tables behind (DDL runs inside one transaction)."""
    from alembic import command

    real = command.upgrade

    def failing(cfg: object, revision: str) -> None:
        real(cfg, revision)  # type: ignore[arg-type]
        raise RuntimeError("boom")

    monkeypatch.setattr(command, "upgrade", failing)
    url = sqlite_url(tmp_path / "kandev.db")
    with pytest.raises(RuntimeError, match="boom"):
        Store.open(url, empty_at_head=False)
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    monkeypatch.undo()
    store = Store.open(url)
    try:
        assert "tasks" in inspect(store.engine).get_table_names()
    finally:
        store.close()
