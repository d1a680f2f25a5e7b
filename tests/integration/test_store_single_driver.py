"""One store, one backend, whatever the home (Issue 10 item 5): real backends, one SQLite file.

Home ``one`` uses its own ``kandev.db``; home ``two`` names that same file in ``database.url``.
The second backend must be refused exactly like a second backend of the same home, and the
store must remember the installation that created it, so a backend of another installation is
refused even when nobody else runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.kandev import db_row
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

RECORD = "SELECT * FROM control_server_record WHERE id = 1"
OWNER = "SELECT value FROM installation WHERE key = 'installation_id'"


def _backend(k) -> subprocess.CompletedProcess[str]:
    """Start a backend of ``k``'s home in the foreground (it exits at once when refused)."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
        capture_output=True, text=True, env=k.env, timeout=60, cwd=REPO_ROOT,
    )


def test_scenario_c_two_homes_one_sqlite_file(kandev_factory):
    """Issue 10 scenario C; AC-EXECUTORS-CONTROL-OWNERSHIP-002.4: two homes, one SQLite file: the second
    backend is refused at start (while the first runs: the store's lock; once it is gone: the
    store belongs to the first installation, both ids named); the first is untouched: it still
    answers and its control-server record is unchanged."""
    first = kandev_factory("one")
    st = first.up()
    _, sid = first.start_session("mine")
    record = db_row(first, RECORD)
    assert record is not None and record["pid"] == st["control_server"]["pid"]
    first_id = (first.home / "installation-id").read_text().strip()
    assert db_row(first, OWNER) == {"value": first_id}  # the store remembers who created it

    shared = first.home / "kandev.db"
    second = kandev_factory("two", f'[database]\nurl = "sqlite:///{shared}"\n')
    refused = _backend(second)
    assert refused.returncode == 1, refused.stderr
    assert f"pid {st['backend']['pid']}" in refused.stderr and f"{shared}.lock is locked" in refused.stderr
    assert not (second.home / "run" / "backend.sock").exists()
    assert not (second.home / "logs" / "backend.log").exists()  # refused before it logs anything

    assert first.status()["backend"]["pid"] == st["backend"]["pid"]
    assert first.show(sid)["state"] == "WAITING_FOR_INPUT"
    assert db_row(first, RECORD) == record  # nobody overwrote the first's control-server record

    first.cli("down")
    after_down = db_row(first, RECORD)
    refused = _backend(second)  # nobody holds the lock now: the store's owner refuses it
    assert refused.returncode == 1, refused.stderr
    second_id = (second.home / "installation-id").read_text().strip()
    assert second_id != first_id
    assert f"belongs to installation {first_id}" in refused.stderr
    assert f"this home is installation {second_id}" in refused.stderr
    assert db_row(first, RECORD) == after_down and db_row(first, OWNER) == {"value": first_id}

    again = first.up()  # the first installation still drives its store
    assert again["backend"]["state"] == "ready"
    assert first.show(sid)["task_id"]
