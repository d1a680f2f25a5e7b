"""``kandev``: the command-line client of the backend socket (README.md#using-it).

``kandev [--home DIR] [--json] COMMAND``. With ``--json`` every command prints
one JSON object on stdout (``follow`` and ``prompt --follow``: one per event).
Without it, output is written for people (``daemon.human``): tables, a
``systemctl status``-like summary, transcripts as conversations, errors as
``kandev: <what went wrong>`` plus a hint; colour only on a terminal without
``NO_COLOR``. Ids may be given as any unique prefix of 4 or more characters.
Exit codes: 0 ok, 1 refused by the backend (typed error on stderr, or in the
JSON as ``error``), 2 usage, 3 backend unreachable. The CLI owns nothing:
``up`` only starts a backend process when no service manager runs one; when the
backend runs but gave up restarting a control server that kept dying, ``up`` asks
it to try again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# Only what every command needs: the parser, the socket client and the protocol version. The doctor,
# the configuration machinery, the agents' registry and the views for people are imported by the
# commands that use them (tests/unit/test_cli_imports.py keeps the common commands to a budget).
from daemon.backend.api import VERSION as API_VERSION
from daemon.human import RECONNECT_TIMEOUT_S
from daemon.paths import Paths, resolve_home
from daemon.version import VERSION
from ipc.errors import ErrorCode, IpcError
from ipc.sync_client import SyncClient

if TYPE_CHECKING:
    from daemon.human.term import Term

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
UP_TIMEOUT_S = 400.0  # covers the longest accepted recovery deadline (5 min) plus start-up
DOWN_TIMEOUT_S = 60.0


class Usage(Exception):
    pass


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


class _Parser(argparse.ArgumentParser):
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


class _Commands:
    """``add_subparsers`` whose every parser takes the global flags and says what it does."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str) -> None:
        self._sub = parser.add_subparsers(dest=dest, required=True, parser_class=_Parser, metavar="COMMAND")

    def add(self, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return _with_globals(self._sub.add_parser(name, help=help, description=description or help))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kandev", description="Run and observe kandev agents (README.md, kandev(1)).")
    p.add_argument("--home", metavar="DIR", help=_GLOBAL_HELP["--home"])
    p.add_argument("--json", action="store_true", help=_GLOBAL_HELP["--json"])
    p.add_argument("--version", action="version", version=f"kandev {VERSION}", help="print kandev's version and exit")
    sub = _Commands(p, "command")

    up = sub.add("up", "start the backend in the background (no service manager); if it runs but gave up"
                 " restarting a control server that kept dying, make it try again")
    up.add_argument("--config", metavar="FILE", help="the configuration file for the backend (checked first;"
                    " default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    down = sub.add("down", "stop the backend gracefully (nothing to do when none runs)")
    down.add_argument("--agents", action="store_true", help="also stop a detached control server and every agent"
                      " (with survival on they otherwise keep running for the next backend)")
    sub.add("status", "backend, capability, control server (running and installed versions), recovery")
    actl = _Commands(sub.add("agentctl", "the control server"), "agentctl_cmd")
    actl.add("reload", "re-execute the control server's installed code in place; its agents keep running (exit 1"
             " if it refuses: the old code keeps serving)")

    store = _Commands(sub.add("store", "the backend's store"), "store_cmd")
    store.add("vacuum", "give the store's free space (after transcript retention or task deletes) back to the"
              " filesystem; prints the size before and after")

    task = _Commands(sub.add("task", "tasks: create, list, show, finish, delete"), "task_cmd")
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

    session = _Commands(sub.add("session", "sessions: start, show, list, stop, configure"), "session_cmd")
    ss = session.add("start", "start an agent session for a task")
    ss.add_argument("task_id", metavar="TASK", help="the task's id (any unique prefix of 4+ characters)")
    ss.add_argument("--agent", default="mock", help="a built-in agent (kandev agents lists them; default: mock)")
    ss.add_argument("--prompt", metavar="TEXT", help="a first prompt, sent once the agent is ready")
    ss.add_argument("--passthrough", action="store_true",
                    help="run the agent under the backend's own control server, never detached (no survival)")
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
    sst = session.add("stop", "end the session's agent (gracefully, then its whole process group); the session"
                      " stays readable and kandev resume gives it an agent again")
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
                     help="config file to check (default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    ag = sub.add("agents", "the built-in agents with package and pinned version, and the names of the variables"
                 " each gets from [agents.NAME] (never a value)")
    ag.add_argument("--config", metavar="FILE",
                    help="config file to read (default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    runtime = _Commands(sub.add("runtime", "managed npm runtimes of the built-in agents"), "runtime_cmd")
    ru = runtime.add("update", "prepare the agent's pinned npm package, repair its own npx cache entry once if that"
                     " fails, then ACP-probe it (progress on stderr; exit 1 if the job fails)")
    ru.add_argument("agent", help="a built-in npm agent (see kandev agents)")
    return p


def _options(pairs: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value:
            raise Usage(f"--option {pair!r}: expected ID=VALUE")
        options[key.strip()] = value
    return options


def _call(socket: Path, op: str, args: dict[str, Any] | None = None, timeout: float | None = 60.0) -> Any:
    with SyncClient(str(socket), protocol_major=API_VERSION[0], timeout=5.0) as client:
        return client.call(op, args or {}, timeout=timeout)


def _print(result: Any) -> None:
    print(json.dumps(result, sort_keys=True, default=str))


def _reachable(socket: Path) -> dict[str, Any] | None:
    try:
        status: dict[str, Any] = _call(socket, "status", timeout=5.0)
        return status
    except IpcError:
        return None


def _gave_up(status: dict[str, Any]) -> list[str]:
    """Which control servers the backend gave up restarting (they kept dying)."""
    server = status.get("control_server") or {}
    links = [("survival", server), ("passthrough", server.get("passthrough") or {})]
    return [name for name, link in links if link.get("state") == "gave_up"]


def _retry_control_server(paths: Paths, status: dict[str, Any]) -> dict[str, Any]:
    """The backend runs but gave up on a control server: ask it to try again and wait for the outcome
    (running, or gave up again after its crash-loop limit)."""
    _call(paths.backend_socket, "control_server_retry", timeout=10.0)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        status = _call(paths.backend_socket, "status", timeout=10.0)
        server = status["control_server"]
        states = {server["state"], (server.get("passthrough") or {}).get("state")}
        if "gave_up" in states:
            loss = (server.get("gave_up") or (server.get("passthrough") or {}).get("gave_up") or {})
            raise IpcError("control_server_gave_up", "the control server still dies at start; the backend gave"
                           f" up again: {loss.get('reason', 'unknown reason')}")
        if not states & {"lost", "restarting"}:
            return {"started": False, "retried": True, "pid": status["backend"]["pid"], "status": status}
        time.sleep(0.1)
    raise IpcError(ErrorCode.TIMEOUT, f"the control server did not come back within {UP_TIMEOUT_S:.0f}s")


def _check_config(config_path: str | None) -> None:
    """What the backend would refuse at start, refused here first, naming file, key, value, range."""
    from daemon.config import check_config, config_file
    from daemon.config_keys import ConfigError

    try:
        check_config(config_path)
    except ConfigError as exc:
        raise IpcError("config_refused", f"the configuration is refused, nothing was started: {exc}",
                       details={"file": config_file(config_path), "key": exc.key}) from None


def _same_config(status: dict[str, Any], config_path: str | None) -> None:
    """``up --config X`` against a backend that runs with another configuration: say so."""
    backend = status.get("backend") or {}
    if config_path is None or "config" not in backend:  # no --config, or a backend too old to say
        return
    running = backend.get("config")
    if running is not None and os.path.realpath(running) == os.path.realpath(config_path):
        return
    raise IpcError("config_mismatch", f"a backend already runs (pid {backend.get('pid')}) with"
                   f" {running or 'no configuration file (defaults)'}; --config {config_path} was not applied",
                   details={"running": running, "given": config_path})


def _this_start(log_path: Path, offset: int) -> list[str]:
    """The lines the backend wrote to its log since ``offset``: this start's, not earlier runs'."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read(64 * 1024).decode("utf-8", errors="replace")
    return [line for line in text.splitlines() if line.strip()][-8:]


def cmd_up(paths: Paths, args: argparse.Namespace) -> dict[str, Any]:
    status = _reachable(paths.backend_socket)
    if status is not None and status["backend"]["state"] == "out_of_space":
        return {"started": False, "pid": status["backend"]["pid"], "status": status}
    if status is not None and status["backend"]["state"] == "ready":
        _same_config(status, args.config)
        if _gave_up(status):
            return _retry_control_server(paths, status)
        return {"started": False, "pid": status["backend"]["pid"], "status": status}
    log_path = paths.logs_dir / "backend.log"
    offset = 0
    if status is None:
        import subprocess

        _check_config(args.config)
        paths.ensure()
        argv = [sys.executable, "-m", "daemon.backend.main", "--home", str(paths.home)]
        if args.config:
            argv += ["--config", args.config]
        # private like everything under the home (it may hold session ids, paths, errors)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
        offset = os.fstat(fd).st_size
        with open(fd, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
    else:
        _same_config(status, args.config)
        proc = None
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            lines = _this_start(log_path, offset)
            raise IpcError("backend_exited", f"the backend exited with code {proc.returncode} at start:\n"
                           + "\n".join(f"  {line}" for line in lines or ["(it wrote nothing)"]))
        status = _reachable(paths.backend_socket)
        # up and serving, or up and waiting for space to open its store (status says so)
        if status is not None and status["backend"]["state"] in ("ready", "out_of_space"):
            return {"started": True, "pid": status["backend"]["pid"], "status": status}
        time.sleep(0.1)
    raise IpcError(ErrorCode.TIMEOUT, f"backend did not become ready within {UP_TIMEOUT_S:.0f}s")


def _exited(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the service user's backend: ask /proc instead
        return not Path(f"/proc/{pid}").exists()
    return False


def _wait_exit(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` exited within ``timeout``: woken by its exit (a pidfd), not by a clock."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd here: look often
        deadline = time.monotonic() + timeout
        while not _exited(pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def _control_server_sockets(paths: Paths) -> list[Path]:
    """Control-server sockets of the home that something listens on (a detached server without a
    backend, after ``kandev down`` with survival on)."""
    import socket as socket_mod

    found = []
    for path in sorted(paths.run_dir.glob("agentctl-*.sock")) if paths.run_dir.is_dir() else []:
        with socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM) as s:
            s.settimeout(1.0)
            try:
                s.connect(str(path))
            except OSError:
                continue
        found.append(path)
    return found


def cmd_down(paths: Paths, args: argparse.Namespace) -> dict[str, Any]:
    try:
        status = _call(paths.backend_socket, "status", timeout=10.0)
    except IpcError as exc:
        if exc.code != ErrorCode.UNAVAILABLE:
            raise
        if not (args.agents and _control_server_sockets(paths)):
            return {"stopped": False, "running": False, "home": str(paths.home)}
        # A detached control server outlived its backend: a backend adopts it (proving it owns it),
        # then stops it with its agents.
        print("kandev: no backend runs, but a detached control server does: starting the backend to stop it"
              " and its agents", file=sys.stderr, flush=True)
        status = cmd_up(paths, argparse.Namespace(config=None))["status"]
    pid = int(status["backend"]["pid"])
    result = _call(paths.backend_socket, "shutdown", {"agents": True} if args.agents else {}, timeout=10.0)
    agents = result.get("agents")
    if args.agents:
        print(f"kandev: stopping the backend (pid {pid}), its control server and its"
              f" {agents if agents is not None else 'every'} agent{'' if agents == 1 else 's'}",
              file=sys.stderr, flush=True)
    if _wait_exit(pid, DOWN_TIMEOUT_S):
        return {"stopped": True, "running": True, "pid": pid, "detached": bool(result.get("detach")),
                "agents": agents}
    raise IpcError(ErrorCode.TIMEOUT, f"backend pid {pid} did not exit within {DOWN_TIMEOUT_S:.0f}s")


def _ensure_runtime(sock: Path, agent: Any) -> None:
    """A managed npm agent's runtime is prepared before its session starts, its steps on stderr
    (the backend would prepare it too, but silently)."""
    from daemon.agents.registry import BUILTIN_AGENTS

    spec = BUILTIN_AGENTS.get(agent) if isinstance(agent, str) else None
    if spec is None or spec.runtime != "npm":
        return
    from daemon.runtimes.cli import ensure_runtime  # the ACP SDK: only when needed

    ensure_runtime(lambda op, a, t: _call(sock, op, a, timeout=t), spec.name, sys.stderr)


def _agents(config_path: str | None) -> dict[str, Any]:
    """The built-in agents, each with the variable names its configuration gives it (no value)."""
    from daemon.agents.registry import BUILTIN_AGENTS
    from daemon.agents.settings import describe
    from daemon.config import Config, load_config
    from daemon.config_keys import ConfigError

    error = None
    try:
        config = load_config(config_path)
    except ConfigError as exc:  # still list the agents (bash completion reads them), and say why
        config, error = Config(), f"the configuration is refused: {exc}"
    return {"config": config.source, "config_error": error, "agents": [
        {"name": a.name, "package": a.package, "version": a.version, "runtime": a.runtime,
         **describe(config.agents.settings, a.name)}
        for a in sorted(BUILTIN_AGENTS.values(), key=lambda a: a.name)]}


def run(args: argparse.Namespace) -> Any:
    paths = Paths.for_home(resolve_home(args.home))
    sock = paths.backend_socket
    cmd = args.command
    if cmd == "up":
        return cmd_up(paths, args)
    if cmd == "down":
        return cmd_down(paths, args)
    if cmd == "status":
        return _call(sock, "status")
    if cmd == "agentctl":  # reload: quiesce + preflight + exec, followed to its outcome
        return _call(sock, "agentctl_reload", timeout=200.0)
    if cmd == "store":  # vacuum
        return _call(sock, "store_vacuum", timeout=3600.0)
    if cmd == "task":
        if args.task_cmd == "proceed":
            return _call(sock, "task_proceed", {"task_id": args.task_id}, timeout=180.0)
        if args.task_cmd == "workflow":
            return _call(sock, "task_workflow", {"task_id": args.task_id})
        if args.task_cmd == "list":
            return _call(sock, "task_list")
        if args.task_cmd == "show":
            return _call(sock, "task_show", {"task_id": args.task_id})
        if args.task_cmd in ("done", "reopen"):
            return _call(sock, f"task_{args.task_cmd}", {"task_id": args.task_id})
        if args.task_cmd == "delete":
            return _call(sock, "task_delete", {"task_id": args.task_id, "stop": args.stop}, timeout=60.0)
        call_args = {"title": args.title, "executor": args.executor}
        if args.workspace:
            call_args["workspace"] = str(Path(args.workspace).resolve())
        if args.steps is not None:
            from daemon.backend.workflow import WorkflowError, parse_steps

            try:
                parse_steps(args.steps)  # refused before the task exists
            except WorkflowError as exc:
                raise Usage(f"--steps: {exc}") from None
        created = _call(sock, "task_create", call_args)
        if args.steps is not None:
            created["workflow"] = _call(sock, "workflow_set", {"task_id": created["task_id"], "steps": args.steps})
        return created
    if cmd == "resume":
        agent = _call(sock, "session_show", {"session_id": args.session_id, "tail": 1}).get("agent")
        _ensure_runtime(sock, agent)
        return _call(sock, "session_resume", {"session_id": args.session_id, "fresh": args.fresh}, timeout=180.0)
    if cmd == "session":
        if args.session_cmd == "start":
            call_args = {"task_id": args.task_id, "agent": args.agent, "passthrough": args.passthrough}
            if args.prompt:
                call_args["prompt"] = args.prompt
            _ensure_runtime(sock, args.agent)
            return _call(sock, "session_start", call_args, timeout=180.0)  # create_instance: up to 150 s
        if args.session_cmd == "show":
            if args.limit is not None and args.after_seq is None:
                raise Usage("session show: --limit goes with --after-seq")
            page = {k: v for k, v in (("tail", args.tail), ("after_seq", args.after_seq), ("limit", args.limit))
                    if v is not None}
            return _call(sock, "session_show", {"session_id": args.session_id, **page})
        if args.session_cmd == "configure":
            call_args = {"session_id": args.session_id, "options": _options(args.option)}
            if args.model is not None:
                call_args["model"] = args.model
            if args.mode is not None:
                call_args["mode"] = args.mode
            return _call(sock, "session_configure", call_args, timeout=180.0)
        if args.session_cmd == "stop":
            return _call(sock, "session_stop", {"session_id": args.session_id}, timeout=60.0)
        if args.session_cmd == "reset-context":
            return _call(sock, "session_reset_context", {"session_id": args.session_id, "restart": args.restart},
                         timeout=180.0)
        # People get the table's columns (newest first); --json stays {sessions: [...]} as it was.
        return _call(sock, "session_list", {} if args.json else {"detail": True})
    if cmd == "prompt":
        return _call(
            sock,
            "prompt",
            {"session_id": args.session_id, "text": args.text, "wait": args.wait},
            timeout=None if args.wait else 60.0,
        )
    if cmd == "cancel":
        return _call(sock, "cancel", {"session_id": args.session_id})
    if cmd == "logs":
        return _call(sock, "session_logs", {"session_id": args.session_id, "tail": args.tail})
    if cmd == "permission":
        call_args = {"session_id": args.session_id, "request_id": args.request_id}
        if args.option:
            call_args["option_id"] = args.option
        return _call(sock, "permission_respond", call_args)
    if cmd == "board":
        return _call(sock, "board") if args.json else _call(sock, "task_list")
    if cmd == "doctor":
        from daemon import doctor

        return doctor.as_json(doctor.run_doctor(paths, config_path=args.config))
    if cmd == "runtime":
        # Imported here: the runtime updater pulls in the ACP SDK, which would add ~0.5 s to every command.
        from daemon.runtimes.cli import runtime_update

        return runtime_update(lambda op, a, t: _call(sock, op, a, timeout=t), args.agent, sys.stderr)
    if cmd == "agents":
        return _agents(args.config)
    raise Usage(f"unknown command {cmd}")


def _term() -> Term:
    from daemon.human.term import Term

    return Term.for_stream(sys.stdout)


def _follow(args: argparse.Namespace, sock: Path, turn_id: str | None = None) -> int:
    from daemon.human.follow import follow

    return follow(str(sock), args.session_id, out=sys.stdout, err=sys.stderr, term=_term(),
                  turn_id=turn_id, follow_all=bool(getattr(args, "all", False)),
                  reconnect_timeout=args.reconnect_timeout, protocol_major=API_VERSION[0], json_lines=args.json)


def _follow_logs(args: argparse.Namespace, sock: Path) -> int:
    """``kandev logs SESSION -f``: the last lines, then what the agent writes, until Ctrl-C. The file
    is read through the backend (it is the service user's); a look every half second."""
    from daemon.human.views import log_text

    page = _call(sock, "session_logs", {"session_id": args.session_id, "tail": args.tail})
    try:
        while True:
            if args.json:
                _print(page)
            elif page["text"]:
                sys.stdout.write(log_text(page["text"], _term()))
            sys.stdout.flush()
            time.sleep(0.5)
            page = _call(sock, "session_logs", {"session_id": args.session_id, "offset": page["offset"]})
    except KeyboardInterrupt:
        return EXIT_OK


def sock_of(args: argparse.Namespace) -> Path:
    return Paths.for_home(resolve_home(args.home)).backend_socket


def run_live(args: argparse.Namespace) -> int | None:
    """Commands that print as things happen (follow, prompt --follow, board --watch): their exit
    status; None for every other command."""
    sock = sock_of(args)
    if args.command == "follow":
        return _follow(args, sock)
    if args.command == "prompt" and args.follow:
        started = _call(sock, "prompt", {"session_id": args.session_id, "text": args.text, "wait": False})
        if args.json:
            print(json.dumps(started, sort_keys=True), flush=True)
        return _follow(args, sock, turn_id=started["turn_id"])
    if args.command == "logs" and args.follow:
        return _follow_logs(args, sock)
    if args.command == "board" and args.watch and not args.json:
        from daemon.human.render import watch_board

        return watch_board(lambda op, a: _call(sock, op, a), args.interval, sys.stdout)
    return None


def _quiet_closed_pipe() -> int:
    """Standard output's reader went away (``kandev status | head -3``): stop quietly, exit 0 as
    ``head`` expects. Later writes (the interpreter's own flush at exit) go to /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # a closed pipe shows here at the latest, while we can still say nothing
        return status
    except BrokenPipeError:
        return _quiet_closed_pipe()


def _main(argv: list[str]) -> int:
    if "__complete" in argv[:3]:  # for bash completion: ids from the backend, quietly
        from daemon.human.complete import complete

        at = argv.index("__complete")
        before = argv[:at]
        home = before[before.index("--home") + 1] if "--home" in before[:-1] else None
        return complete((["--home", home] if home else []) + argv[at + 1:], sys.stdout)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = run_live(args)
        if status is not None:
            return status
        result = run(args)
    except Usage as exc:
        print(f"kandev: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IpcError as exc:
        code = EXIT_UNREACHABLE if exc.code == ErrorCode.UNAVAILABLE else EXIT_REFUSED
        if args.json:
            print(json.dumps({"error": exc.to_wire()}, sort_keys=True))
            print(f"kandev: {exc.code}: {exc.message}", file=sys.stderr)
        else:
            from daemon.human.errors import error_lines

            for line in error_lines(exc, args.command, getattr(args, "session_id", None)):
                print(line, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        return 130
    if args.command == "doctor":  # exit 1 when a check fails; text: one line per check
        from daemon import doctor
        from daemon.platform import Check

        checks = [Check(c["name"], c["ok"], c["detail"], c["hint"]) for c in result["checks"]]
        print(json.dumps(result, sort_keys=True) if args.json else doctor.as_text(checks))
        return EXIT_OK if result["ok"] else EXIT_REFUSED
    if args.command == "agents" and not args.json:
        for a in result["agents"]:
            secret = ", ".join(f"{var} <- {ref}" for var, ref in a["secret_env"].items())
            files = ", ".join(f"~/{dest} <- {src}" for dest, src in a.get("home_files", {}).items())
            print(f"{a['name']}\t{a['package']}\t{a['version']}\tenv: {', '.join(a['env']) or '-'}"
                  f"\tsecret_env: {secret or '-'}\thome_files: {files or '-'}")
    if args.command == "agents" and result.get("config_error"):
        if args.json:
            _print(result)
        print(f"kandev: {result['config_error']}", file=sys.stderr)
        return EXIT_REFUSED
    if args.command == "agents" and not args.json:
        return EXIT_OK
    if args.json:
        _print(result)
    else:
        from daemon.human.render import render

        render(args, result, sys.stdout, lambda op, a: _call(sock_of(args), op, a, timeout=10.0))
    if args.command == "runtime" and result.get("state") != "succeeded":
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
