"""Helpers shared by every part of the test suite (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parent.parent


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value.

    Bounded: raises ``TimeoutError`` after ``timeout`` seconds (the predicate is tried one
    last time at the deadline). Exceptions raised by the predicate propagate at once.
    """
    if timeout < 0 or interval <= 0:
        raise ValueError(f"wait_until: bad timeout={timeout!r} / interval={interval!r}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now >= deadline:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise TimeoutError(f"wait_until: {what} still false after {timeout:g}s (last value {value!r})")
        time.sleep(min(interval, deadline - now))


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
    else the venv setup.sh creates."""
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin" / "python"
    return default_venv_dir() / "bin" / "python"
