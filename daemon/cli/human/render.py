"""Which human view prints which command's result, and ``board --watch``.

``render`` is what ``kandev`` does with a result when ``--json`` is not given. ``call(op, args)``
asks the backend for what a view needs besides the result (the task title in ``session show``).
"""

from __future__ import annotations

import argparse
import time

from daemon.cli.human import views
from daemon.cli.human.errors import error_lines
from daemon.cli.human.status import render_status
from daemon.cli.human.term import Term
from daemon.cli.human.visible import visible_data
from ipc.errors import IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import IO, Any

    Call = Callable[[str, dict[str, Any]], Any]  # one backend operation: (op, args) -> result

_TASK_VIEWS = {"create": views.task_create_lines, "proceed": views.task_proceed_lines,
               "workflow": views.task_workflow_lines, "list": views.task_list_lines, "show": views.task_show_lines,
               "delete": views.task_delete_lines, "done": views.task_done_lines, "reopen": views.task_reopen_lines}
_SESSION_VIEWS = {"configure": views.session_configure_lines, "reset-context": views.session_reset_lines,
                  "stop": views.session_stop_lines}


def _lines(args: argparse.Namespace, result: Any, term: Term) -> list[str]:
    cmd = args.command
    if cmd == "status":
        return render_status(result, term)
    if cmd == "hosts":
        return views.hosts_lines(result, term)
    if cmd == "up":
        return views.up_lines(result, term)
    if cmd == "down":
        return views.down_lines(result, term)
    if cmd == "board":
        return views.board_lines(result, term)
    if cmd == "task":
        return _TASK_VIEWS[args.task_cmd](result, term)
    if cmd == "session" and args.session_cmd == "start":
        return views.session_start_lines(result, term, args.agent)
    if cmd == "session" and args.session_cmd == "list":
        return views.session_list_lines(result, term, args.all)
    if cmd == "session":
        return _SESSION_VIEWS[args.session_cmd](result, term)
    if cmd == "resume":
        return views.resume_lines(result, term)
    if cmd == "prompt":
        return views.prompt_lines(result, term, args.session_id)
    if cmd == "cancel":
        return views.cancel_lines(args.session_id)
    if cmd == "logs":
        return views.logs_lines(result, term)
    if cmd == "permission":
        return views.permission_lines(args.session_id, args.request_id, args.option)
    if cmd == "runtime":
        return views.runtime_lines(result, term)
    if cmd == "agentctl":
        return views.agentctl_reload_lines(result, term)
    raise ValueError(f"no human view for {cmd}")


def render(args: argparse.Namespace, result: Any, out: IO[str], call: Call) -> None:
    """Print ``result`` of the command ``args`` for people (its strings made ``visible``)."""
    term = Term.for_stream(out)
    result = visible_data(result)
    if args.command == "session" and args.session_cmd == "show":
        title = None
        try:
            title = call("task_show", {"task_id": result["task_id"]}).get("title")
        except (IpcError, KeyError):
            pass  # the header then goes without the task's title
        views.session_show(result, term, out, title)
        return
    for line in _lines(args, result, term):
        out.write(line + "\n")


def watch_board(call: Call, interval: float, out: IO[str]) -> int:
    """``board --watch``: look every ``interval`` seconds and print the board again when it changed
    (redrawn in place on a terminal that takes escape sequences, else one after the other), until
    Ctrl-C (exit 0). The first look failing fails the command."""
    from daemon.cli.human.interrupt import UntilInterrupted  # only this command needs it

    term = Term.for_stream(out)
    shown: list[str] | None = None
    with UntilInterrupted() as stop:
        while not stop.requested:
            try:
                lines = views.board_lines(visible_data(call("task_list", {})), term)
            except IpcError as exc:
                if shown is None:
                    raise
                lines = error_lines(exc)  # e.g. the backend restarts: say so, keep looking
            if lines != shown:
                in_place = term.colour  # a terminal that takes escape sequences (no NO_COLOR)
                if in_place:
                    out.write("\x1b[H\x1b[2J")
                header = term.dim(f"kandev board, every {interval:g}s (Ctrl-C to stop)   {time.strftime('%H:%M:%S')}")
                out.write("\n".join([header, *lines]) + "\n" + ("" if in_place else "\n"))
                out.flush()
                shown = lines
            time.sleep(interval)
    return 0
