"""Alembic environment for the kandev store.

Run programmatically by ``daemon.store.db.migrate``: the caller passes an open
connection in ``config.attributes["connection"]``. Without one (an operator
running alembic by hand), ``sqlalchemy.url`` from the alembic config is used.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from daemon.store.models import Base

target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(context.config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("kandev migrations run online only")
run_migrations_online()
