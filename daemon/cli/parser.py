"""The ``kandev`` command line's grammar: every command, flag and argument type (``build_parser``),
the exit codes, and how a usage error is said (``Usage``; argparse's "invalid choice" as
``did_you_mean``). Imported by every command: only argparse and the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator

from daemon.cli.call import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE
from daemon.cli.human import RECONNECT_TIMEOUT_S, terminal_columns
from daemon.core.version import VERSION

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any, NoReturn

__all__ = ["EXIT_OK", "EXIT_REFUSED", "EXIT_UNREACHABLE", "EXIT_USAGE", "Usage", "build_parser", "did_you_mean"]


class Usage(Exception):
    """A command line the CLI refuses before asking the backend (exit status 2)."""


_INVALID_CHOICE = r"argument (?P<arg>\S+): invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)"


def did_you_mean(message: str) -> str:
    """argparse's "invalid choice" as people say it: the unknown command and the closest one."""
    import difflib
    import re

    m = re.fullmatch(_INVALID_CHOICE, message)
    if m is None:
        return message
    choices = re.findall(r"'([^']*)'", m["choices"])
    close = difflib.get_close_matches(m["given"], choices, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"one of: {', '.join(choices)}"
    if m["arg"].startswith("-"):
        return f"{m['arg']}: '{m['given']}' is not a choice; {hint}"
    return f"unknown command '{m['given']}'; {hint}"


@functools.cache
def _columns() -> int:
    """The terminal's width as argparse would ask shutil for it (fallback 80), asked once."""
    return terminal_columns(80)


class _Formatter(argparse.HelpFormatter):
    """argparse's help layout, with the terminal's width asked once: argparse makes a formatter for
    every ``add_argument`` (to check its metavar), and each asked shutil for the width again."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=_columns() - 2)  # argparse's own margin


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)  # subcommands' parsers get it too
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # argparse exits 2 already; keep the message format ours
        self.print_usage(sys.stderr)
        print(f"kandev: {did_you_mean(message)}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _page_size(text: str) -> int:
    value = _whole(text)
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not in 1..10000")
    return value


def _cursor(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 3600] seconds")
    return value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


_GLOBAL_HELP = {"--home": "the kandev home whose backend to use (default: $KANDEV_HOME, $STATE_DIRECTORY,"
                " ~/.local/share/kandev)", "--json": "print one JSON object on stdout (for scripts)"}


def _with_globals(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--home`` and ``--json`` after a command too (``kandev status --json``); given there, they win
    over the same flags before the command, and not given there, they change nothing."""
    parser.add_argument("--home", default=argparse.SUPPRESS, metavar="DIR", help=_GLOBAL_HELP["--home"])
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=_GLOBAL_HELP["--json"])
    return parser


class _Arguments:
    """A command's arguments as the grammar declares them (``add_argument``,
    ``add_mutually_exclusive_group``), added to the command's parser only when a command line names
    that command: adding every command's arguments was most of building the parser, and a call uses
    one command."""

    def __init__(self) -> None:
        self._calls: list[tuple[_Arguments | None, tuple[Any, ...], dict[str, Any]]] = []

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        self._calls.append((None, args, kwargs))

    def add_mutually_exclusive_group(self, **kwargs: Any) -> _Arguments:
        group = _Arguments()
        self._calls.append((group, (), kwargs))
        return group

    def add_to(self, parser: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
        for group, args, kwargs in self._calls:
            if group is None:
                parser.add_argument(*args, **kwargs)
            else:
                group.add_to(parser.add_mutually_exclusive_group(**kwargs))


class _Declared:
    """A command as the grammar declares it, its parser not built yet: argparse's ``add_parser``
    makes one of these (it is the sub-commands' ``parser_class``), and ``build`` makes the parser
    when a command line names the command. Building every command's parser and arguments was most
    of building the grammar, and a call uses one command."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs  # what add_parser gives the parser: prog, description
        self.arguments = _Arguments()

    def build(self) -> argparse.ArgumentParser:
        parser = _with_globals(_Parser(**self.kwargs))
        self.arguments.add_to(parser)
        return parser


class _CommandAction(argparse._SubParsersAction):  # type: ignore[type-arg]
    """argparse's sub-command action, which first builds the named command's parser (once)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _build_command(self, values[0] if values else None)
        super().__call__(parser, namespace, values, option_string)


def _build_command(action: _CommandAction, name: Any) -> None:
    declared = action.choices.get(name) if isinstance(action.choices, dict) else None
    if isinstance(declared, _Declared):
        with _translations_remembered():
            action.choices[name] = declared.build()  # choices is the action's name -> parser map


class _Commands:
    """``add_subparsers`` whose every parser takes the global flags and says what it does: ``add``
    declares a command (its parser built when a command line names it), ``group`` one with commands
    of its own, whose help ends with the names of its commands as they are added (``kandev task
    --help`` lists what ``kandev task`` takes, never a command that is not there)."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str,
                 about: tuple[str, argparse.Action] | None = None) -> None:
        action = parser.add_subparsers(dest=dest, required=True, parser_class=_Declared,  # type: ignore[type-var]
                                       metavar="COMMAND", action=_CommandAction)
        assert isinstance(action, _CommandAction)
        self._sub = action
        self._parser = parser
        self._about = about  # a group's: what it is about, and its line in its parent's help
        self._names: list[str] = []

    def add(self, name: str, help: str, description: str | None = None) -> _Arguments:
        declared: Any = self._sub.add_parser(name, help=help, description=description or help)
        assert isinstance(declared, _Declared)
        self._added(name)
        return declared.arguments

    def _added(self, name: str) -> None:
        self._names.append(name)
        if self._about is not None:
            about, line = self._about
            line.help = self._parser.description = f"{about}: {', '.join(self._names)}"

    def group(self, name: str, about: str, dest: str) -> _Commands:
        """A command with commands of its own; ``about``: what they are about (e.g. "tasks")."""
        self._sub.add_parser(name, help=about, description=about)
        line = self._sub._choices_actions[-1]  # the group's line in this parser's help
        _build_command(self._sub, name)
        self._added(name)
        return _Commands(self._sub.choices[name], dest, (about, line))


def _complete(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every command's parser built now, as a command line naming it would (for what reads the
    whole grammar: bash completion's and the docs' tests)."""
    for action in parser._actions:
        if isinstance(action, _CommandAction):
            for name in list(action.choices or ()):
                _build_command(action, name)
                _complete(action.choices[name])
    return parser


@contextlib.contextmanager
def _translations_remembered() -> Iterator[None]:
    """While the parser is built, argparse's answers from gettext are remembered. argparse asks
    for the same few strings (its group titles, "show this help message and exit") once per
    parser, ~100 times here, and gettext remembers no miss: each time it looks for catalogue files
    again, some eight stat calls, which was half of building the parser. The answers cannot change
    within one process; what argparse asks afterwards (its error messages) goes to gettext again."""
    plain = vars(argparse)["_"]
    vars(argparse)["_"] = functools.lru_cache(maxsize=None)(plain)  # the name argparse calls
    try:
        yield
    finally:
        vars(argparse)["_"] = plain


def build_parser(complete: bool = False) -> argparse.ArgumentParser:
    """The grammar, each command's arguments added when a command line names it (``complete``: all
    of them now)."""
    with _translations_remembered():
        parser = _build_parser()
        return _complete(parser) if complete else parser


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kandev", description="Run and observe kandev agents (README.md, kandev(1)).")
    p.add_argument("--home", metavar="DIR", help=_GLOBAL_HELP["--home"])
    p.add_argument("--json", action="store_true", help=_GLOBAL_HELP["--json"])
    p.add_argument("--version", action="version", version=f"kandev {VERSION}", help="print kandev's version and exit")
    sub = _Commands(p, "command")

    up = sub.add("up", "start the backend in the background (no service manager); if it runs but gave up"
                 " restarting a control server that kept dying, make it try again")
    up.add_argument("--config", metavar="FILE", help="the configuration file for the backend (checked first;"
                    " default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    up.add_argument("--survival", action="store_true", help="agent survival on for this backend: its agents and"
                    " their turns keep running when it stops or restarts (as features.agent_survival = true)")
    down = sub.add("down", "stop the backend gracefully (nothing to do when none runs)")
    down.add_argument("--agents", action="store_true", help="also stop a detached control server and every agent"
                      " (with survival on they otherwise keep running for the next backend)")
    sub.add("status", "backend, capability, control server (running and installed versions), recovery")
    sub.add("hosts", "the cluster's hosts (several backends on one PostgreSQL): state, version, sessions,"
            " agents, last heartbeat")
    actl = sub.group("agentctl", "the control server", "agentctl_cmd")
    actl.add("reload", "re-execute the control server's installed code in place; its agents keep running (exit 1"
             " if it refuses: the old code keeps serving)")

    store = sub.group("store", "the backend's store", "store_cmd")
    store.add("vacuum", "give the store's free space (after transcript retention or task deletes) back to the"
              " filesystem; prints the size before and after")

    task = sub.group("task", "tasks", "task_cmd")
    tc = task.add("create", "create a task")
    tc.add_argument("--title", required=True, help="what the task is about (shown on the board)")
    tc.add_argument("--workspace", metavar="DIR", help="the agents' working directory (default: a new directory"
                    " under the home)")
    tc.add_argument("--executor", choices=["local", "worktree"], default="local",
                    help="local: agents work in the workspace itself; worktree: in a git worktree of it on branch"
                    " kandev/TASK (default: local)")
    tc.add_argument("--steps", help="workflow steps 'name[:reset][:prompt=TEXT],...' (e.g."
                    " 'plan,implement:reset:prompt=Implement it'); the first is entered at once")
    tp = task.add("proceed", "enter the task's next workflow step: its context reset, then its prompt")
    tp.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    tw = task.add("workflow", "the task's workflow steps and where it is")
    tw.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    task.add("list", "every task: title, bucket, sessions, agent, workflow step")
    tsh = task.add("show", "one task: title, workspace, executor, bucket, workflow, its sessions")
    tsh.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    tdo = task.add("done", "mark the task done: it moves to DONE on the board (its sessions stay readable)")
    tdo.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    tre = task.add("reopen", "take a done task back: it goes where its latest session puts it")
    tre.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    td = task.add("delete", "remove a task whose sessions have no agent: its sessions, their directories (the"
                  " agents' HOMEs), and its workspace if kandev created it")
    td.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    td.add_argument("--stop", action="store_true", help="stop the task's idle agents first (a running turn"
                    " is still refused: kandev cancel it)")

    session = sub.group("session", "sessions", "session_cmd")
    ss = session.add("start", "start an agent session for a task")
    ss.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    ss.add_argument("--agent", default="mock", help="a built-in agent (kandev agents lists them; default: mock)")
    ss.add_argument("--prompt", metavar="TEXT", help="a first prompt, sent once the agent is ready")
    ss.add_argument("--passthrough", action="store_true",
                    help="run the agent under the backend's own control server, never detached (no survival)")
    ss.add_argument("--host", metavar="NAME", help="cluster mode: the host whose backend runs the agent (kandev"
                    " hosts lists them; default: this host)")
    sh = session.add("show", "one session: state, agent, turns, one page of its transcript")
    sh.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    where = sh.add_mutually_exclusive_group()
    where.add_argument("--tail", type=_page_size, metavar="N",
                       help="the last N transcript entries (default: the last 10000)")
    where.add_argument("--after-seq", type=_cursor, metavar="S",
                       help="the entries after cursor S (a page's next_cursor; 0: from the start)")
    sh.add_argument("--limit", type=_page_size, metavar="N", help="with --after-seq: at most N entries (default 10000)")
    sl = session.add("list", "sessions, newest first (finished ones with --all; --json: every session)")
    sl.add_argument("--all", action="store_true", help="also COMPLETED and CANCELLED sessions")
    sst = session.add("stop", "end the session's agent at once, a running turn too (gracefully, then its whole"
                      " process group); the session stays readable and kandev resume gives it an agent again")
    sst.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    sc = session.add("configure", "set the agent's model, mode and options (applied through the agent)")
    sc.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    sc.add_argument("--model", metavar="M", help="the model (the agent's config option of category model)")
    sc.add_argument("--mode", metavar="X", help="the agent's mode (e.g. plan, code; the agent lists its own)")
    sc.add_argument("--option", action="append", default=[], metavar="ID=VALUE", help="a config option (repeatable)")
    sr = session.add("reset-context", "a new provider session with model, mode and options restored")
    sr.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    sr.add_argument("--restart", action="store_true",
                    help="restart the agent process instead of a new ACP session on the same process")

    rs = sub.add("resume", "give a session that lost its agent an agent again (session/load)")
    rs.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    rs.add_argument("--fresh", action="store_true", help="start a new provider conversation (wipes the token)")

    pr = sub.add("prompt", "send a prompt to a session")
    pr.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    pr.add_argument("text", help="the prompt (quote it; the mock agent also takes /slow N, /fail, /permission...)")
    how = pr.add_mutually_exclusive_group()
    how.add_argument("--wait", action="store_true", help="wait for the turn to end")
    how.add_argument("--follow", action="store_true",
                     help="print the agent's output as it arrives until the turn ends (exit 1 if it ends badly)")
    pr.add_argument("--reconnect-timeout", type=_seconds, default=RECONNECT_TIMEOUT_S, metavar="S",
                    help=f"with --follow: how long to wait for a lost backend (default {RECONNECT_TIMEOUT_S:g})")
    fo = sub.add("follow", "print a session's current (or last) turn as the agent writes it")
    fo.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    fo.add_argument("--all", action="store_true", help="keep following every later turn until Ctrl-C")
    fo.add_argument("--reconnect-timeout", type=_seconds, default=RECONNECT_TIMEOUT_S, metavar="S",
                    help=f"how long to wait for a lost backend before exit status 3 (default {RECONNECT_TIMEOUT_S:g})")
    lo = sub.add("logs", "the agent's standard error (its own log lines: the session's current or last agent)")
    lo.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    lo.add_argument("-f", "--follow", action="store_true", help="keep printing lines as the agent writes them,"
                    " until Ctrl-C")
    lo.add_argument("--tail", type=_page_size, default=50, metavar="N", help="the last N lines (default 50)")
    pe = sub.add("permission", "answer an agent's open permission request")
    pe.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    pe.add_argument("request_id", metavar="REQUEST", help="the request's id (shown by follow and session show)")
    choice = pe.add_mutually_exclusive_group(required=True)
    choice.add_argument("--option", help="the option id to choose (see session show: permissions)")
    choice.add_argument("--cancel", action="store_true", help="answer the request as cancelled")
    ca = sub.add("cancel", "cancel the session's running turn (exit 1 when none runs)")
    ca.add_argument("session_id", metavar="SESSION", help="the session's id (any unique prefix of 4+ characters)")
    bo = sub.add("board", "tasks by bucket, NEEDS ATTENTION first with the reason")
    bo.add_argument("--watch", action="store_true", help="redraw when the board changes, until Ctrl-C")
    bo.add_argument("--interval", type=_seconds, default=1.0, metavar="S", help="with --watch: seconds between looks")
    doc = sub.add("doctor", "check this installation (no backend needed); exit 1 if a check fails")
    doc.add_argument("--config", metavar="FILE",
                     help="a config file to check instead of the running backend's (with none running:"
                     " $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    ag = sub.add("agents", "the built-in agents with package and pinned version, and the names of the variables"
                 " each gets from [agents.NAME] (never a value)")
    ag.add_argument("--config", metavar="FILE",
                    help="a config file to read instead of the running backend's (with none running:"
                    " $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    runtime = sub.group("runtime", "managed npm runtimes of the built-in agents", "runtime_cmd")
    ru = runtime.add("update", "prepare the agent's pinned npm package, repair its own npx cache entry once if that"
                     " fails, then ACP-probe it (progress on stderr; exit 1 if the job fails)")
    ru.add_argument("agent", help="a built-in npm agent (see kandev agents)")
    return p
