"""``kandev``: the command-line client of the backend socket (README.md#using-it).

``kandev [--home DIR] [--json] COMMAND``. With ``--json`` every command prints
one JSON object on stdout (``follow`` and ``prompt --follow``: one per event).
Without it, output is written for people (``daemon.cli.human``): tables, a
``systemctl status``-like summary, transcripts as conversations, errors as
``kandev: <what went wrong>`` plus a hint; colour only on a terminal without
``NO_COLOR``. Ids may be given as any unique prefix of 4 or more characters.
Exit codes: 0 ok, 1 refused by the backend (typed error on stderr, or in the
JSON as ``error``), 2 usage, 3 backend unreachable. The CLI owns nothing:
``up`` only starts a backend process when no service manager runs one; when the
backend runs but gave up restarting a control server that kept dying, ``up`` asks
it to try again.

This module is the entry point, and it has two paths. A command line the quick path serves
(``daemon.cli.quick``: the calls scripts make most, one backend operation each under ``--json``, and
``--help``) is answered without argparse, json, socket or enum, whose imports alone cost more than
the interpreter's own start. Every other command line goes to the full path (``daemon.cli.commands``:
the whole grammar, every command, output for people). Both print the same for what both serve
(tests/unit/test_cli_quick.py).
"""

from __future__ import annotations

import gc
import os
import sys


def _quiet_closed_pipe() -> int:
    """Standard output's reader went away (``kandev status | head -3``): stop quietly, exit 0 as
    ``head`` expects. Later writes (the interpreter's own flush at exit) go to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        from daemon.cli.quick import serve

        status = serve(args)
        if status is None:
            from daemon.cli.commands import run_command_line

            status = run_command_line(args)
        sys.stdout.flush()  # a closed pipe shows here at the latest, while we can still say nothing
        return status
    except BrokenPipeError:
        return _quiet_closed_pipe()
    finally:
        if argv is None:  # the process's own command line: it exits next
            # Its objects frozen out of the collector: the interpreter's teardown then does not
            # walk them all once more before the kernel frees them (~5 ms of a 50 ms call).
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
