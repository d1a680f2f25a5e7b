"""The quick path of ``kandev``: the command lines scripts run most, served without the grammar.

A CLI call is a whole interpreter start, and the modules the full path needs before it can answer
(argparse and json import ``re``, socket imports ``enum``) cost more than that start again. This
module serves, without them:

- ``kandev --version``;
- ``kandev --help`` (or ``-h``) laid out for 80 columns (output that is not a terminal, without
  ``$COLUMNS``, or an 80-column terminal): the text argparse prints then, kept in
  ``daemon/cli/help.txt``; at other widths argparse lays it out;
- ``kandev [--home DIR] --json COMMAND ARG...`` for the commands of ``QUICK``: one backend operation
  each, whose arguments are positional.

Anything else returns None, and the full path (``daemon.cli.commands``) runs: another command, an
option of a command (``--tail``), an argument that starts with ``-``, output for people, a usage
error. What this path accepts, argparse parses to the same operation with the same arguments, and
both print the same (tests/unit/test_cli_quick.py runs every form through both, and checks the
stored help against argparse's).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

HELP_COLUMNS = 80  # the width the stored help is laid out for
HELP_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "help.txt")

# The command words -> (the backend operation, the names of its positional arguments in order, the
# arguments the full path adds when no option is given, the call's timeout in seconds).
QUICK: dict[tuple[str, ...], tuple[str, tuple[str, ...], dict[str, Any], float]] = {
    ("status",): ("status", (), {}, 60.0),
    ("board",): ("board", (), {}, 60.0),
    ("task", "list"): ("task_list", (), {}, 60.0),
    ("task", "show"): ("task_show", ("task_id",), {}, 60.0),
    ("task", "workflow"): ("task_workflow", ("task_id",), {}, 60.0),
    ("task", "done"): ("task_done", ("task_id",), {}, 60.0),
    ("task", "reopen"): ("task_reopen", ("task_id",), {}, 60.0),
    ("session", "list"): ("session_list", (), {}, 60.0),
    ("session", "show"): ("session_show", ("session_id",), {}, 60.0),
    ("session", "stop"): ("session_stop", ("session_id",), {}, 60.0),
    ("cancel",): ("cancel", ("session_id",), {}, 60.0),
    ("prompt",): ("prompt", ("session_id", "text"), {"wait": False}, 60.0),
    ("logs",): ("session_logs", ("session_id",), {"tail": 50}, 60.0),
}


class QuickCall:
    """A command line the quick path serves: its ``--home`` (None: not given), the operation, its
    arguments and the call's timeout."""

    __slots__ = ("home", "op", "args", "timeout")

    def __init__(self, home: str | None, op: str, args: dict[str, Any], timeout: float) -> None:
        self.home, self.op, self.args, self.timeout = home, op, args, timeout


def parse(argv: list[str]) -> QuickCall | None:
    """``argv`` as a quick call, or None when it is not one of the forms this path serves."""
    home: str | None = None
    as_json = False
    words: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--json":  # before or after the command, as the grammar takes it
            as_json = True
        elif token == "--home":
            if i + 1 == len(argv) or argv[i + 1].startswith("-"):
                return None
            i += 1
            home = argv[i]  # the last one given wins, as in the grammar
        elif token.startswith("--home="):
            home = token[len("--home="):]
        elif token.startswith("-"):
            return None
        else:
            words.append(token)
        i += 1
    if not as_json:
        return None
    for n in (1, 2):
        form = QUICK.get(tuple(words[:n]))
        if form is not None and len(words) - n == len(form[1]):
            op, names, fixed, timeout = form
            return QuickCall(home, op, {**dict(zip(names, words[n:], strict=True)), **fixed}, timeout)
    return None


def serve(argv: list[str]) -> int | None:
    """Run ``argv`` if this path serves it: the exit status; None when the full path must."""
    if argv in (["--help"], ["-h"]):
        return _help()
    if argv == ["--version"]:  # what argparse's version action prints
        from daemon.core.version import VERSION

        print(f"kandev {VERSION}")
        return 0
    quick = parse(argv)
    if quick is None:
        return None
    from daemon.cli.call import EXIT_OK, call, exit_status
    from daemon.cli.json_output import json_line, print_json_error
    from daemon.host.home import backend_socket_path, resolve_home_dir
    from ipc.errors import IpcError

    try:
        result = call(backend_socket_path(resolve_home_dir(quick.home)), quick.op, quick.args, quick.timeout)
    except IpcError as exc:
        print_json_error(exc)
        return exit_status(exc)
    except KeyboardInterrupt:
        return 130
    print(json_line(result))
    return EXIT_OK


def _help() -> int | None:
    from daemon.cli.human import terminal_columns

    if terminal_columns(HELP_COLUMNS) != HELP_COLUMNS:
        return None
    try:
        with open(HELP_FILE, encoding="utf-8") as f:
            text = f.read()
    except OSError:  # an installation without it: argparse lays the help out
        return None
    sys.stdout.write(text)
    return 0
