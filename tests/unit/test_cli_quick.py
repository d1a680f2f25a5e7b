"""The quick path of ``kandev`` (daemon/cli/quick.py, Issue 24 item 3) against the full path: every
form it serves, run through both with the backend call recorded, makes the same call and prints the
same (result and refusal alike); what it does not serve goes to the full path; its stored ``--help``
is what argparse prints at 80 columns."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

import daemon.cli.call
import daemon.cli.commands
from daemon.cli import quick as cli_quick
from daemon.cli.quick import QUICK, parse, serve
from ipc.errors import ErrorCode, IpcError
from tests.support.paths import REPO_ROOT

RESULT = {"b": [1, 2.5, None, True], "a": "é\u2028", "c": {"z": 1, "y": 10**30}}

# Every quick form, with the global flags where people put them (before, after, repeated).
FORMS = [
    ["--json", "status"], ["status", "--json"], ["--home", "/h1", "--json", "--home=/h2", "status"],
    ["--json", "board"],
    ["--json", "task", "list"], ["task", "--json", "list"],
    ["--json", "task", "show", "abcd"], ["--json", "task", "workflow", "abcd"],
    ["--json", "task", "done", "abcd"], ["--json", "task", "reopen", "abcd", "--home", "/h3"],
    ["--json", "session", "list"], ["--json", "session", "show", "abcd1234"], ["--json", "session", "stop", "abcd"],
    ["--json", "cancel", "abcd"],
    ["--json", "prompt", "abcd", "fix the bug, then /slow 2"], ["--json", "prompt", "abcd", ""],
    ["--json", "logs", "abcd"],
]


def _through(path: str, argv: list[str], monkeypatch: pytest.MonkeyPatch,
         answer: object = RESULT) -> tuple[int | None, str, str, list[tuple[object, ...]]]:
    """``argv`` through one path with the backend call recorded: (exit status, stdout, stderr, calls)."""
    calls: list[tuple[object, ...]] = []

    def call(sock: str, op: str, args: dict[str, object] | None = None, timeout: float | None = 60.0) -> object:
        calls.append((str(sock), op, args or {}, timeout))
        if isinstance(answer, IpcError):
            raise answer
        return answer

    monkeypatch.setattr(daemon.cli.call, "call", call)
    monkeypatch.setattr(daemon.cli.commands, "call", call)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = serve(argv) if path == "quick" else daemon.cli.commands.run_command_line(argv)
    return status, out.getvalue(), err.getvalue(), calls


def test_the_forms_cover_every_quick_command() -> None:
    parsed = [parse(f) for f in FORMS]
    assert {q.op for q in parsed if q is not None} == {op for op, _, _, _ in QUICK.values()}


@pytest.mark.parametrize("argv", FORMS, ids=" ".join)
def test_a_quick_form_makes_the_full_paths_call_and_prints_the_same(argv: list[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KANDEV_HOME", "/the/env/home")
    assert parse(argv) is not None
    quick = _through("quick", argv, monkeypatch)
    full = _through("full", argv, monkeypatch)
    assert quick == full
    assert quick[0] == 0 and len(quick[3]) == 1 and quick[1].endswith("\n")


@pytest.mark.parametrize("error", [IpcError(ErrorCode.NOT_FOUND, "no session abcd", details={"id": "abcd"}),
                                   IpcError(ErrorCode.UNAVAILABLE, "cannot connect to /x: No such file")])
def test_a_refusal_is_printed_and_ends_the_same_through_both(error: IpcError, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["--json", "session", "show", "abcd"]
    quick = _through("quick", argv, monkeypatch, answer=error)
    full = _through("full", argv, monkeypatch, answer=error)
    assert quick == full
    assert quick[0] == (3 if error.code == ErrorCode.UNAVAILABLE else 1)
    assert '"error": {' in quick[1] and quick[2] == f"kandev: {error.code}: {error.message}\n"


def test_an_unreachable_backend_is_exit_3_with_the_same_words(tmp_path: Path) -> None:
    """The real client, no backend: the quick path says what the full path says."""
    argv = ["--home", str(tmp_path), "--json", "status"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        quick = serve(argv)
    full_out, full_err = io.StringIO(), io.StringIO()
    with redirect_stdout(full_out), redirect_stderr(full_err):
        full = daemon.cli.commands.run_command_line(argv)
    assert (quick, out.getvalue(), err.getvalue()) == (full, full_out.getvalue(), full_err.getvalue())
    assert quick == 3 and "cannot connect to" in err.getvalue()


@pytest.mark.parametrize("argv", [
    ["status"],                                          # for people: the views
    ["--json", "session", "show", "abcd", "--tail", "5"],  # an option of the command
    ["--json", "prompt", "abcd", "-x"],                  # an argument that starts with "-"
    ["--json", "prompt", "abcd"],                        # an argument missing
    ["--json", "task", "show", "abcd", "efgh"],          # one too many
    ["--json", "task"],                                  # a group without its command
    ["--json", "session", "start", "abcd"],              # a command it does not serve
    ["--json", "nosuch"], ["--json", "status", "-h"], ["--json", "--home"], ["--json", "--home", "--json", "status"],
    ["--jso", "status"],                                 # argparse's abbreviations are the grammar's
    ["--json", "--", "status"], [],
])
def test_what_the_quick_path_does_not_serve_goes_to_the_full_path(argv: list[str]) -> None:
    assert parse(argv) is None
    assert argv in (["--help"], ["-h"]) or serve(argv) is None


def test_the_stored_help_is_what_argparse_prints_at_80_columns() -> None:
    p = subprocess.run([sys.executable, "-c", "from daemon.cli.commands import run_command_line;"
                        " run_command_line(['--help'])"], capture_output=True, text=True, cwd=REPO_ROOT,
                       env={**os.environ, "COLUMNS": "80"}, timeout=60)
    assert p.returncode == 0, p.stderr
    stored = Path(cli_quick.HELP_FILE).read_text(encoding="utf-8")
    assert stored == p.stdout, ("daemon/cli/help.txt is stale; regenerate it with: COLUMNS=80 python -c"
                                " 'from daemon.cli.commands import run_command_line; run_command_line([\"--help\"])'"
                                " > daemon/cli/help.txt")


@pytest.mark.parametrize("columns", ["80", "120"])
def test_help_is_the_stored_text_at_80_columns_and_argparse_at_others(columns: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    for flag in ("--help", "-h"):
        out = io.StringIO()
        with redirect_stdout(out):
            status = serve([flag])
        if columns == "80":
            assert (status, out.getvalue()) == (0, Path(cli_quick.HELP_FILE).read_text(encoding="utf-8"))
        else:
            assert (status, out.getvalue()) == (None, "")


def test_version_is_what_argparse_prints() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        quick = serve(["--version"])
    full_out = io.StringIO()
    with redirect_stdout(full_out), pytest.raises(SystemExit) as full:
        daemon.cli.commands.run_command_line(["--version"])
    assert (quick, out.getvalue()) == (full.value.code or 0, full_out.getvalue())
    assert out.getvalue().startswith("kandev ")
