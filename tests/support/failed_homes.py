"""Keeping what a failed integration test's daemons left: their logs and store.

A ``kandev_factory`` home lives in a temporary directory that is removed at teardown, so a test
that fails once in twenty runs (a race) used to leave nothing to read. When the test's call
failed, ``keep`` copies each home's ``logs/`` and store files to
``/var/tmp/kandev-failed-tests/<test>-<pid>/<home>/`` (0700, root's like the homes) and says
where; only the newest ``KEEP_AT_MOST`` such directories are kept.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

KEPT_UNDER = Path("/var/tmp/kandev-failed-tests")
KEEP_AT_MOST = 20
_STORE_FILES = ("kandev.db", "kandev.db-wal", "kandev.db-shm")


def keep(test_id: str, pid: int, homes: list[Path]) -> Path | None:
    """Copy the logs and store of ``homes`` for the failed test ``test_id``; the directory, or
    None when no home had anything to keep."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)[-120:]
    target = KEPT_UNDER / f"{name}-{pid}"
    KEPT_UNDER.mkdir(mode=0o700, exist_ok=True)
    KEPT_UNDER.chmod(0o700)
    kept = False
    for home in homes:
        dest = target / home.name
        if (home / "logs").is_dir():
            shutil.copytree(home / "logs", dest / "logs", dirs_exist_ok=True, symlinks=True)
            kept = True
        for store_file in _STORE_FILES:
            if (home / store_file).is_file():
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(home / store_file, dest / store_file)
                kept = True
    if not kept:
        return None
    _prune()
    return target


def _prune() -> None:
    kept = sorted(KEPT_UNDER.iterdir(), key=lambda p: p.stat().st_mtime)
    for old in kept[:-KEEP_AT_MOST]:
        shutil.rmtree(old, ignore_errors=True)
