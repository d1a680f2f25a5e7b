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


# ---------------------------------------------------------------- attacking from inside an agent (Issue 10)


def attack_script(denied: dict[str, list[str]], allowed: dict[str, list[str]]) -> str:
    """A shell script for the mock agent's ``/sh``: each named attempt runs one command and prints
    ``NAME=ok`` or ``NAME=denied`` (its exit status), so ``attempt_results`` can read them back.

    ``denied``/``allowed``: name -> argv, what the caller expects to fail / to succeed (the split
    only documents intent; ``attack_verdicts`` compares)."""
    import shlex

    lines = ['t() { n=$1; shift; if "$@" >/dev/null 2>&1; then echo "$n=ok"; else echo "$n=denied"; fi; }']
    for name, argv in {**denied, **allowed}.items():
        assert " " not in name and "=" not in name, name
        lines.append("t " + " ".join(shlex.quote(a) for a in [name, *argv]))
    return "; ".join(lines)


def attempt_results(output: str) -> dict[str, str]:
    """``NAME=ok|denied`` lines of an ``attack_script`` run, as a dict."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        name, sep, verdict = line.strip().partition("=")
        if sep and verdict in ("ok", "denied"):
            out[name] = verdict
    return out


def connect_argv(socket_path: str) -> list[str]:
    """A command that connects to a Unix socket (exit 0 only if the connection is accepted)."""
    return ["python3", "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])",
            socket_path]


def attack_verdicts(output: str, denied: dict[str, list[str]], allowed: dict[str, list[str]]) -> list[str]:
    """What went differently from the expectation (empty: every denied attempt failed and every
    allowed one succeeded); missing lines count as wrong too."""
    got = attempt_results(output)
    wrong = [f"{n}: {got.get(n, 'missing')} (expected denied)" for n in denied if got.get(n) != "denied"]
    wrong += [f"{n}: {got.get(n, 'missing')} (expected ok)" for n in allowed if got.get(n) != "ok"]
    return wrong
