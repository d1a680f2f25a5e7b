"""daemon.store: migrations from empty, schema equals the models, SQLite settings, constraints."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config as AlembicConfig
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from daemon.store.db import MIGRATIONS_DIR, Store, sqlite_url
from daemon.store.models import Base, ControlServerRecord, Task, TaskSession


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(sqlite_url(tmp_path / "kandev.db"))
    yield s
    s.close()


def _head() -> str:
    """The one head revision of the shipped migrations (a second head would be a broken chain)."""
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    heads = ScriptDirectory.from_config(cfg).get_heads()
    assert len(heads) == 1, f"migrations have several heads: {heads}"
    return heads[0]


def _session(store: Store) -> str:
    with store.session() as db:
        task = Task(title="t")
        db.add(task)
        db.flush()
        ts = TaskSession(task_id=task.id, agent="mock")
        db.add(ts)
        db.flush()
        return ts.id


def test_store_migrates_from_empty(tmp_path: Path, store: Store) -> None:
    tables = set(inspect(store.engine).get_table_names())
    assert tables == set(Base.metadata.tables) | {"alembic_version"}
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == _head()
    assert stat.S_IMODE(os.stat(tmp_path / "kandev.db").st_mode) == 0o600
    store.close()
    Store.open(sqlite_url(tmp_path / "kandev.db")).close()  # reopening is a no-op upgrade


def test_store_schema_matches_models(any_store: Store) -> None:
    """The migrations build exactly the models' schema, on SQLite and on PostgreSQL."""
    with any_store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []


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
        Store.open(url)
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []
    engine.dispose()
    monkeypatch.undo()
    store = Store.open(url)
    try:
        assert "tasks" in inspect(store.engine).get_table_names()
    finally:
        store.close()
