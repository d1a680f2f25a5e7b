"""Issue 46 Why 1 (Issue 46 item 1): the README's quick start works as written from a fresh clone
anywhere, /tmp too.

The commands are read from README.md's "Quick start" block (never copied here), from its first line
to the one that runs ``kandev --version`` (the demo after it is not run: it is a long turn of its
own), and run by bash, one script, in a fresh ``git clone`` of this checkout under ``/tmp`` (with
this checkout's uncommitted changes to tracked files), with a PATH that has no venv on it. Before
Issue 46, set-up put a /tmp clone's venv in /var/tmp and made no ``./.venv``: ``kandev --version``
said ``command not found``.

Cheap: the clone's path is the same on every run of this checkout, so set-up finds its venv (in
/var/tmp, named after that path) already made and only checks it; the first run makes it from the
machine's pip cache and wheels. The time each run took is printed (``-s`` shows it).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from daemon.core.version import VERSION
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(600)

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def quick_start_commands(readme: Path) -> list[str]:
    """The quick start block's commands up to ``kandev --version``, comments removed."""
    lines = readme.read_text().splitlines()
    start = lines.index("## Quick start")
    commands: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("    ") or not line.strip():
            if commands:
                break
            continue
        command = re.sub(r"\s+#\s.*$", "", line.strip())
        commands.append(command)
        if command == "kandev --version":
            return commands
    raise AssertionError(f"README.md's quick start has no `kandev --version` line: {commands}")


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=120).stdout


def fresh_clone(where: Path) -> Path:
    """A new clone of this checkout at ``where``: its HEAD, plus its uncommitted changes to tracked
    files (``git stash create`` makes a commit of them without touching the checkout)."""
    commit = _git("stash", "create").strip() or _git("rev-parse", "HEAD").strip()
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    _git("clone", "--quiet", "--no-checkout", str(REPO_ROOT), str(where))
    _git("-c", "advice.detachedHead=false", "checkout", "--quiet", commit, cwd=where)
    return where


def test_the_quick_start_works_as_written_from_a_fresh_clone_under_tmp() -> None:
    """Issue 46 Why 1 (Issue 46 item 1, acceptance A): set-up, then the README's PATH line, then
    `kandev --version` prints the version, in a fresh clone under /tmp; `kandev` is the clone's."""
    commands = quick_start_commands(REPO_ROOT / "README.md")
    assert commands[0].startswith("bash packaging/dev/setup.sh") and any("PATH=" in c for c in commands), commands
    tag = hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]
    base = Path(f"/tmp/kandev-quick-start-{tag}")
    base.mkdir(mode=0o700, exist_ok=True)
    with open(base / ".lock", "w") as lock:  # one run per checkout at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        clone = fresh_clone(base / "kandev")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KANDEV_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        env["PATH"] = SYSTEM_PATH  # no venv of this checkout on it
        script = "set -euo pipefail\n" + "\n".join(commands) + "\ncommand -v kandev\n"
        started = time.monotonic()
        p = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=560)
        took = time.monotonic() - started
        print(f"the quick start took {took:.1f} s (set-up included)")
        assert p.returncode == 0, (commands, p.stdout[-3000:], p.stderr[-3000:])
        out = p.stdout.splitlines()
        assert f"kandev {VERSION}" in out, p.stdout
        assert out[-1] == str(clone / ".venv" / "bin" / "kandev"), p.stdout  # the clone's own kandev
        assert (clone / ".venv" / "bin" / "python").exists()
        shutil.rmtree(clone, ignore_errors=True)
