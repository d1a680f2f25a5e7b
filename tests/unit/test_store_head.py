"""A backend's start skips alembic when the store is at the newest revision (Issue 24 item 3:
a start imports only what it needs). The cheap reading of the newest revision must agree with
alembic's own, and a store at head must open without importing alembic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.config import Config
from alembic.script import ScriptDirectory

from daemon.store.db import MIGRATIONS_DIR, Store, head_revision, sqlite_url


def test_head_revision_is_alembics_head() -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    assert head_revision() == ScriptDirectory.from_config(cfg).get_current_head()


_PROBE = ("import sys; from daemon.store.db import Store; s = Store.open(sys.argv[1]); s.close();"
          " print(sorted(m for m in sys.modules if m.split('.')[0] == 'alembic'))")


def _alembic_modules_of_an_open(url: str) -> str:
    done = subprocess.run([sys.executable, "-c", _PROBE, url], capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip() + done.stderr


def test_a_store_at_head_opens_without_alembic(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "kandev.db")
    Store.open(url, empty_at_head=False).close()  # built by the migrations: alembic runs
    assert _alembic_modules_of_an_open(url) == "[]"


def test_a_new_store_is_created_without_alembic(tmp_path: Path) -> None:
    """A new home's first start: the empty database is created at head, no migration replayed."""
    assert _alembic_modules_of_an_open(sqlite_url(tmp_path / "kandev.db")) == "[]"
