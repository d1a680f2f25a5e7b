"""Fixtures shared by tests/unit, tests/integration and tests/systemd (helpers: tests/support)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.store.db import Store, sqlite_url
from tests.support import npm_runtimes
from tests.support.paths import REPO_ROOT, venv_python_path
from tests.support.postgres import PgCluster
from tests.support.postgres import require as postgres_bin
from tests.support.schedule import module_rank


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as on a terminal, however the suite was started. A non-interactive shell starts a
    background job (``bash .ci/run &``) with SIGINT ignored, every process inherits that, and a
    CLI started that way rightly ignores Ctrl-C: the tests that stop ``board --watch`` or
    ``follow`` with SIGINT would then wait for it forever. Each pytest process (the workers run
    this too) takes Python's own handler back, so the processes it starts begin with the default."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root directory (where pyproject.toml is)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> Path:
    """The dev venv's python (has kandev installed editable, plus its dependencies)."""
    py = venv_python_path()
    if not py.exists():
        pytest.fail(f"no dev venv python at {py}: run `bash packaging/dev/setup.sh` first", pytrace=False)
    return py


@pytest.fixture(scope="session")
def postgres(request: pytest.FixtureRequest) -> Iterator[PgCluster]:
    """One throwaway PostgreSQL server per test process, started and stopped by pytest-xprocess
    (tests/support/postgres.py); ``new_database()`` gives each test an empty database."""
    cluster = PgCluster(postgres_bin()).start(request.config)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def pg_store(postgres: PgCluster) -> Iterator[Store]:
    """A store on an empty database of the test PostgreSQL, every table created (no migrations)."""
    from sqlalchemy import create_engine

    from daemon.store.models import Base

    engine = create_engine(postgres.new_database())
    Base.metadata.create_all(engine)
    s = Store(engine)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A migrated, empty SQLite store in the test's own directory (``kandev.db``), closed after the
    test. A module that needs another store (``any_store``'s engines, or rows to start with) defines
    its own ``store`` fixture, which takes the place of this one there."""
    s = Store.open(sqlite_url(tmp_path / "kandev.db"))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A migrated, empty store on each engine kandev supports: an SQLite file, and a database on
    a real PostgreSQL server (the ``postgres`` fixture is started only for that parameter)."""
    if request.param == "sqlite":
        url = sqlite_url(tmp_path / "kandev.db")
    else:
        url = request.getfixturevalue("postgres").new_database()
    store = Store.open(url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="session")
def claude_npm_cache() -> Path:
    """An npm cache with the pinned claude-code runtime prepared in it (tests/support/npm_runtimes.py),
    once per machine; give it to daemons as ``npm_config_cache``."""
    return npm_runtimes.cache_or_skip("claude-code")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first (tests/support/schedule.py); tests keep their order in a module."""
    root = config.rootpath

    def rank(item: pytest.Item) -> int:
        try:
            return module_rank(item.path.relative_to(root).as_posix())
        except ValueError:
            return module_rank(str(item.path))

    items.sort(key=rank)  # a stable sort: every other order is kept
