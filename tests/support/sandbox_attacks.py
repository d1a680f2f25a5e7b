"""Attacking from inside an agent (the agent sandbox): a shell script of named attempts for the
mock agent's ``/sh``, each printing ``NAME=ok|denied``, and the check of its output against what
must fail and what must succeed."""

from __future__ import annotations

import shlex


def attack_script(denied: dict[str, list[str]], allowed: dict[str, list[str]]) -> str:
    """A shell script for the mock agent's ``/sh``: each named attempt runs one command and prints
    ``NAME=ok`` or ``NAME=denied`` (its exit status), so ``attempt_results`` can read them back.

    ``denied``/``allowed``: name -> argv, what the caller expects to fail / to succeed (the split
    only documents intent; ``attack_verdicts`` compares)."""
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
