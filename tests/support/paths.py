"""Where things are: the checkout's root and the dev venv's python (keep in sync with
packaging/dev/setup.sh)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def default_venv_dir(repo: Path = REPO_ROOT) -> Path:
    """Where packaging/dev/setup.sh puts the dev venv (keep the two rules in sync)."""
    if os.environ.get("KANDEV_VENV"):
        return Path(os.environ["KANDEV_VENV"]).absolute()
    repo_s = str(repo)
    if (repo_s + "/").startswith("/tmp/"):
        return Path("/var/tmp/kandev-venv-" + hashlib.sha256(repo_s.encode()).hexdigest()[:12])
    return repo / ".venv"


def venv_python_path() -> Path:
    """The dev venv's python: the running interpreter when it is a venv (as under test.sh),
    else the venv setup.sh creates. Named by its real path: a /tmp checkout's ``.venv`` is a link to
    the venv in /var/tmp, and only the latter is visible in a systemd test box."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix).resolve() / "bin" / "python"
    return default_venv_dir() / "bin" / "python"
