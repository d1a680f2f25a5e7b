"""Opening the store: engine, SQLite settings, migrations at start, and sessions.

``Store.open(url)`` creates the engine, runs the alembic migrations to head (an
empty database is created at head directly) and returns a ``Store``. For SQLite
every connection gets ``journal_mode=WAL``, ``synchronous=FULL`` (the control-server
record must be durable before a credential is confirmed,
AC-EXECUTORS-CONTROL-OWNERSHIP-002.7), ``foreign_keys=ON`` and ``busy_timeout=5000``, a
checkpoint every ``WAL_CHECKPOINT_PAGES`` pages of write-ahead log whose file is then cut
back to ``WAL_SIZE_LIMIT`` (so the log does not keep megabytes the transcript does not
need), and a new database file is created 0600.

A PostgreSQL engine (Issue 47 item 5) checks a pooled connection that was idle for
``PING_IDLE_S`` or more before handing it out (``watch_connections``, SQLAlchemy's ``pool_pre_ping``
without its round trip on every transaction: a flood commits a batch every few milliseconds on a
connection that just worked): one the server ended while it sat in the pool (a restart,
``pg_terminate_backend``, an idle timeout) is replaced instead of failing the next call. One that
dies in use fails that call (``daemon.store.reach``), and SQLAlchemy then renews the whole pool.
It gives up connecting after
``PG_CONNECT_TIMEOUT_S`` unless ``database.url`` sets ``connect_timeout`` itself, with TCP
keepalives on, so that a server that is gone is found out (``daemon.store.reach``) rather than
waited on for ever.

With pysqlite's default transaction handling a transaction begins at the
first write, so reads before it see the latest committed data. Guarded writes
therefore use compare-and-set (see ``transitions``), never "read, then write".
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    create_engine,
    event,
    inspect,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_MS = 5000
WAL_CHECKPOINT_PAGES = 256
"""Pages the write-ahead log grows to before a commit checkpoints it (SQLite's default is 1000)."""
WAL_SIZE_LIMIT = 1024 * 1024
"""Bytes the write-ahead log file is cut back to once checkpointed (it never shrinks otherwise)."""
PING_IDLE_S = 1.0
"""Seconds a pooled PostgreSQL connection may sit unused before it is checked when handed out."""
PG_CONNECT_TIMEOUT_S = 5
"""Seconds a new PostgreSQL connection may take (libpq's ``connect_timeout``) unless the URL says."""
PG_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
"""libpq's TCP keepalives: a peer that vanished without a word is noticed within about 25 s."""


def sqlite_url(path: Path | str) -> str:
    """The SQLAlchemy URL of an SQLite file."""
    return URL.create("sqlite", database=str(Path(path).absolute())).render_as_string()


def sqlite_file(url: URL) -> Path | None:
    """The database file of an SQLite URL; None for another engine, memory or a ``file:`` URI."""
    if url.get_backend_name() != "sqlite":
        return None
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:"):
        return None
    return Path(db)


def engine_options(url: URL, connect_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """``create_engine``'s options for ``url``: the driver's ``connect_args`` (the database password,
    ``daemon.config.database``) and, for PostgreSQL, a connect timeout and keepalives (each unless
    the URL sets it)."""
    extra = dict(connect_args or {})
    if url.get_backend_name() != "postgresql":
        return {"connect_args": extra} if extra else {}
    args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S, **PG_KEEPALIVES}
    return {"connect_args": {**{k: v for k, v in args.items() if k not in url.query}, **extra}}


def _note_checkin(_dbapi_connection: Any, record: Any) -> None:
    record.info["kandev_used_at"] = time.monotonic()


def watch_connections(engine: Engine) -> None:
    """A PostgreSQL engine's pool checks a connection that sat idle for ``PING_IDLE_S`` (or is
    handed out for the first time) before use, with the dialect's own ping (what ``pool_pre_ping``
    does on every checkout); one that does not answer is replaced (``DisconnectionError``: the pool
    connects anew, and a server that is gone fails there)."""
    dialect = engine.dialect

    def ping_if_idle(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        used = record.info.get("kandev_used_at")
        if used is not None and time.monotonic() - used < PING_IDLE_S:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError(f"a pooled connection no longer answers: {exc}") from exc

    event.listen(engine, "checkin", _note_checkin)
    event.listen(engine, "checkout", ping_if_idle)


def _create_private_file(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except FileExistsError:
        pass


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
        cursor.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    finally:
        cursor.close()


_REVISION_LINE = re.compile(r'^(down_revision|revision)\s*(?::[^=]*)?=\s*(?:"([^"]*)"|None)\s*$', re.M)


def head_revision() -> str | None:
    """The newest migration's revision, read from the migration files' ``revision`` and
    ``down_revision`` lines without importing alembic (most of a second of a backend's start):
    the one revision no other revision names as its parent; None if that is not exactly one."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        found = dict((m.group(1), m.group(2)) for m in _REVISION_LINE.finditer(path.read_text(encoding="utf-8")))
        if found.get("revision"):
            revisions.add(found["revision"])
        if found.get("down_revision"):
            parents.add(found["down_revision"])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def _at_head(engine: Engine, head: str | None) -> bool:
    """Whether the store already records ``head``, the newest revision (then a start needs no alembic)."""
    if head is None:
        return False
    with engine.connect() as connection:
        if not inspect(connection).has_table("alembic_version"):
            return False
        rows = connection.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    return [r[0] for r in rows] == [head]


def _alembic_version_table() -> Table:
    """The table alembic records a database's revision in, as alembic itself creates it."""
    return Table("alembic_version", MetaData(), Column("version_num", String(32), nullable=False),
                 PrimaryKeyConstraint("version_num", name="alembic_version_pkc"))


def _create_at_head(connection: Connection, head: str) -> None:
    """An empty database gets the models' schema and the newest revision in one go (alembic's own
    recipe for a new database: create the tables, stamp the head). The migrations build exactly
    that schema (tests/unit/test_store_schema.py compares the two, constraints included), and
    skipping them spares a new home's first start most of half a second (importing alembic,
    replaying every migration)."""
    from daemon.store.models import Base

    Base.metadata.create_all(connection)
    version = _alembic_version_table()
    version.create(connection)
    connection.execute(version.insert().values(version_num=head))


def migrate(engine: Engine, *, empty_at_head: bool = True) -> None:
    """Upgrade the database to the newest revision, in one transaction (nothing to do, and alembic
    not even imported, when the store is at the newest revision already; an empty database is
    created at the newest revision directly, ``_create_at_head``, unless ``empty_at_head`` is
    False: the tests that prove the migrations build the models' schema).

    On SQLite foreign keys are off while migrating: a batch migration
    recreates a table, and dropping the old one with foreign keys on would
    cascade-delete its children. The keys are checked before committing.
    """
    head = head_revision()
    if _at_head(engine, head):
        return
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        try:
            with connection.begin():
                if sqlite:  # pysqlite would run DDL outside any transaction
                    connection.exec_driver_sql("BEGIN IMMEDIATE")
                if empty_at_head and head is not None and not inspect(connection).get_table_names():
                    _create_at_head(connection, head)
                else:
                    _upgrade(connection)
                if sqlite and connection.exec_driver_sql("PRAGMA foreign_key_check").first():
                    raise RuntimeError("migration left rows violating foreign keys; rolled back")
        finally:
            if sqlite:
                connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                connection.commit()


def _upgrade(connection: Connection) -> None:
    """alembic's upgrade to head on ``connection``, inside the caller's transaction."""
    from alembic import command
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, "head")


class Store:
    """The backend's database. ``session()`` is the unit of work."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, *, empty_at_head: bool = True, connect_args: dict[str, Any] | None = None) -> Store:
        """Connect, migrate to head (``migrate``), and return the store. ``connect_args``: the driver's
        connection arguments (the database password, never part of the URL:
        ``daemon.config.database``). A PostgreSQL connection is checked before each use, so a
        restarted server is reconnected to rather than failing the next unit of work."""
        parsed = make_url(url)
        path = sqlite_file(parsed)
        if path is not None:
            _create_private_file(path)
        engine = create_engine(parsed, **engine_options(parsed, connect_args))
        if parsed.get_backend_name() == "sqlite":
            event.listen(engine, "connect", _on_sqlite_connect)
        elif parsed.get_backend_name() == "postgresql":
            watch_connections(engine)
        try:
            migrate(engine, empty_at_head=empty_at_head)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    @property
    def session_factory(self) -> sessionmaker[Session]:
        """What ``session()`` makes its sessions with (for SQLAlchemy session event listeners)."""
        return self._sessions

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block succeeds and rolls back when it raises."""
        with self._sessions() as db:
            try:
                yield db
                db.commit()
            except BaseException:
                db.rollback()
                raise

    def close(self) -> None:
        self.engine.dispose()
