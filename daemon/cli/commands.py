"""The full path of ``kandev`` (``daemon.cli``): a command line parsed by the grammar
(``daemon.cli.parser``), each command mapped to its backend operation, and the result printed (JSON,
or through ``daemon.cli.human``). The socket call is ``daemon.cli.call``; ``up`` and ``down`` are
``daemon.cli.backend_client``. Imported only for a command line the quick path (``daemon.cli.quick``) does
not serve.
"""

from __future__ import annotations

import argparse
import sys
import time

# Only what every command needs: the parser, the socket client and the protocol version. The doctor,
# the configuration machinery, the agents' registry and the views for people are imported by the
# commands that use them (tests/unit/test_cli_imports.py keeps the common commands to a budget).
from daemon.api.version import VERSION as API_VERSION
from daemon.cli.backend_client import cmd_down, cmd_up
from daemon.cli.call import EXIT_OK, EXIT_REFUSED, EXIT_USAGE, call, exit_status
from daemon.cli.json_output import json_line, print_json_error
from daemon.cli.parser import Usage, build_parser
from daemon.host.home import backend_socket_path, resolve_home_dir
from ipc.errors import IpcError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

    from daemon.cli.human.term import Term


def _options(pairs: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value:
            raise Usage(f"--option {pair!r}: expected ID=VALUE")
        options[key.strip()] = value
    return options


def _print(result: Any) -> None:
    print(json_line(result))


def _ensure_runtime(sock: str, agent: Any) -> None:
    """A managed npm agent's runtime is prepared before its session starts, its steps on stderr
    (the backend would prepare it too, but silently)."""
    from daemon.agents.registry import BUILTIN_AGENTS

    spec = BUILTIN_AGENTS.get(agent) if isinstance(agent, str) else None
    if spec is None or spec.runtime != "npm":
        return
    from daemon.runtimes.cli import ensure_runtime  # the ACP SDK: only when needed

    ensure_runtime(lambda op, a, t: call(sock, op, a, timeout=t), spec.name, sys.stderr)


def _agents(sock: str, config_path: str | None) -> dict[str, Any]:
    """The built-in agents, each with the variable names its configuration gives it (no value):
    the running backend's configuration unless ``--config`` names a file (daemon.cli.config_read)."""
    from daemon.agents.network import describe as network_of
    from daemon.agents.registry import BUILTIN_AGENTS
    from daemon.cli.config_read import read_config
    from daemon.config.settings import agent_network
    from daemon.config.view import config_from_view

    view = read_config(sock, config_path)
    error = view.get("error")
    networks = view.get("networks") or {}  # each agent's network as the backend computed it
    if not networks:  # a view of a file (or of a backend of another version): computed here
        config = config_from_view(view)
        networks = {name: network_of(agent_network(config, name)) for name in BUILTIN_AGENTS}
    return {"config": view.get("file"), "read_by": view["read_by"], "reason": view["reason"],
            "config_error": f"the configuration is refused: {error}" if error else None,
            "problems": view.get("problems") or [],
            "agents": [{"name": a.name, "package": a.package, "version": a.version, "runtime": a.runtime,
                        # a backend of another version may not know this agent: nothing configured
                        **(view["agents"].get(a.name) or {"env": [], "secret_env": {}, "home_files": {}}),
                        "network": networks.get(a.name)}
                       for a in sorted(BUILTIN_AGENTS.values(), key=lambda a: a.name)]}


def run(args: argparse.Namespace) -> Any:
    home = resolve_home_dir(args.home)
    sock = backend_socket_path(home)
    cmd = args.command
    if cmd in ("up", "down"):
        from daemon.host.paths import Paths  # every path of the home: only up and down need them

        return (cmd_up if cmd == "up" else cmd_down)(Paths.for_home(home), args)
    if cmd == "status":
        return call(sock, "status")
    if cmd == "hosts":
        return call(sock, "hosts")
    if cmd == "agentctl":  # reload: quiesce + preflight + exec, followed to its outcome
        return call(sock, "agentctl_reload", timeout=200.0)
    if cmd == "store":  # vacuum
        return call(sock, "store_vacuum", timeout=3600.0)
    if cmd == "task":
        if args.task_cmd == "proceed":
            return call(sock, "task_proceed", {"task_id": args.task_id}, timeout=180.0)
        if args.task_cmd == "workflow":
            return call(sock, "task_workflow", {"task_id": args.task_id})
        if args.task_cmd == "list":
            return call(sock, "task_list")
        if args.task_cmd == "show":
            return call(sock, "task_show", {"task_id": args.task_id})
        if args.task_cmd in ("done", "reopen"):
            return call(sock, f"task_{args.task_cmd}", {"task_id": args.task_id})
        if args.task_cmd == "delete":
            return call(sock, "task_delete", {"task_id": args.task_id, "stop": args.stop}, timeout=60.0)
        call_args = {"title": args.title, "executor": args.executor}
        if args.workspace:
            from pathlib import Path

            call_args["workspace"] = str(Path(args.workspace).resolve())
        if args.steps is not None:
            from daemon.store.workflow_steps import WorkflowError, parse_steps

            try:
                parse_steps(args.steps)  # refused before the task exists
            except WorkflowError as exc:
                raise Usage(f"--steps: {exc}") from None
        created = call(sock, "task_create", call_args)
        if args.steps is not None:
            created["workflow"] = call(sock, "workflow_set", {"task_id": created["task_id"], "steps": args.steps})
        return created
    if cmd == "resume":
        shown = call(sock, "session_show", {"session_id": args.session_id, "tail": 1})
        if shown.get("on_this_host", True):  # another host of a cluster prepares its own runtimes
            _ensure_runtime(sock, shown.get("agent"))
        return call(sock, "session_resume", {"session_id": args.session_id, "fresh": args.fresh}, timeout=180.0)
    if cmd == "session":
        if args.session_cmd == "start":
            call_args = {"task_id": args.task_id, "agent": args.agent, "passthrough": args.passthrough}
            if args.prompt:
                call_args["prompt"] = args.prompt
            if args.host:
                call_args["host"] = args.host
            else:
                _ensure_runtime(sock, args.agent)  # another host prepares its own runtimes
            return call(sock, "session_start", call_args, timeout=180.0)  # create_instance: up to 150 s
        if args.session_cmd == "show":
            if args.limit is not None and args.after_seq is None:
                raise Usage("session show: --limit goes with --after-seq")
            page = {k: v for k, v in (("tail", args.tail), ("after_seq", args.after_seq), ("limit", args.limit))
                    if v is not None}
            return call(sock, "session_show", {"session_id": args.session_id, **page})
        if args.session_cmd == "configure":
            call_args = {"session_id": args.session_id, "options": _options(args.option)}
            if args.model is not None:
                call_args["model"] = args.model
            if args.mode is not None:
                call_args["mode"] = args.mode
            return call(sock, "session_configure", call_args, timeout=180.0)
        if args.session_cmd == "stop":
            return call(sock, "session_stop", {"session_id": args.session_id}, timeout=60.0)
        if args.session_cmd == "reset-context":
            return call(sock, "session_reset_context", {"session_id": args.session_id, "restart": args.restart},
                         timeout=180.0)
        # People get the table's columns (newest first); --json stays {sessions: [...]} as it was.
        return call(sock, "session_list", {} if args.json else {"detail": True})
    if cmd == "prompt":
        return call(
            sock,
            "prompt",
            {"session_id": args.session_id, "text": args.text, "wait": args.wait},
            timeout=None if args.wait else 60.0,
        )
    if cmd == "cancel":
        return call(sock, "cancel", {"session_id": args.session_id})
    if cmd == "logs":
        return call(sock, "session_logs", {"session_id": args.session_id, "tail": args.tail})
    if cmd == "permission":
        call_args = {"session_id": args.session_id, "request_id": args.request_id}
        if args.option:
            call_args["option_id"] = args.option
        return call(sock, "permission_respond", call_args)
    if cmd == "board":
        return call(sock, "board") if args.json else call(sock, "task_list")
    if cmd == "doctor":
        from daemon.cli import doctor
        from daemon.host.paths import Paths

        return doctor.as_json(doctor.run_doctor(Paths.for_home(home), config_path=args.config))
    if cmd == "runtime":
        # Imported here: the runtime updater pulls in the ACP SDK, which would add ~0.5 s to every command.
        from daemon.runtimes.cli import runtime_update

        return runtime_update(lambda op, a, t: call(sock, op, a, timeout=t), args.agent, sys.stderr)
    if cmd == "agents":
        return _agents(sock, args.config)
    raise Usage(f"unknown command {cmd}")


def _term() -> Term:
    from daemon.cli.human.term import Term

    return Term.for_stream(sys.stdout)


def _follow(args: argparse.Namespace, sock: str, turn_id: str | None = None) -> int:
    from daemon.cli.human.follow import follow

    return follow(sock, args.session_id, out=sys.stdout, err=sys.stderr, term=_term(),
                  turn_id=turn_id, follow_all=bool(getattr(args, "all", False)),
                  reconnect_timeout=args.reconnect_timeout, protocol_major=API_VERSION[0], json_lines=args.json)


LOGS_WAIT_S = 10
"""``logs -f``: how long one ask waits for the agent to write (the backend answers at the change)."""
LOGS_PACE_S = 1.0
"""``logs -f``: at most one ask per this many seconds (an agent that writes all the time is read in
bigger pieces; on another host of a cluster each ask is a request row in the shared database)."""


def _follow_logs(args: argparse.Namespace, sock: str) -> int:
    """``kandev logs SESSION -f``: the last lines, then what the agent writes, until Ctrl-C. The file
    is read through the backend (it is the service user's), which answers once it changes."""
    from daemon.cli.human.interrupt import UntilInterrupted
    from daemon.cli.human.views import log_text

    asked = time.monotonic()
    page = call(sock, "session_logs", {"session_id": args.session_id, "tail": args.tail})
    with UntilInterrupted() as stop:
        while not stop.requested:
            if args.json:
                _print(page)
            elif page["text"]:
                sys.stdout.write(log_text(page["text"], _term()))
            sys.stdout.flush()
            time.sleep(max(0.0, asked + LOGS_PACE_S - time.monotonic()))
            asked = time.monotonic()
            page = call(sock, "session_logs", {"session_id": args.session_id, "offset": page["offset"],
                                               "wait_s": LOGS_WAIT_S}, timeout=LOGS_WAIT_S + 60.0)
    return EXIT_OK


def sock_of(args: argparse.Namespace) -> str:
    return backend_socket_path(resolve_home_dir(args.home))


def run_live(args: argparse.Namespace) -> int | None:
    """Commands that print as things happen (follow, prompt --follow, board --watch): their exit
    status; None for every other command."""
    sock = sock_of(args)
    if args.command == "follow":
        return _follow(args, sock)
    if args.command == "prompt" and args.follow:
        started = call(sock, "prompt", {"session_id": args.session_id, "text": args.text, "wait": False})
        if args.json:
            print(json_line(started), flush=True)
        return _follow(args, sock, turn_id=started["turn_id"])
    if args.command == "logs" and args.follow:
        return _follow_logs(args, sock)
    if args.command == "board" and args.watch and not args.json:
        from daemon.cli.human.render import watch_board

        return watch_board(lambda op, a: call(sock, op, a), args.interval, sys.stdout)
    return None


def run_command_line(argv: list[str]) -> int:
    """Parse ``argv`` with the whole grammar, run the command, print its result: the exit status."""
    if "__complete" in argv[:3]:  # for bash completion: ids from the backend, quietly
        from daemon.cli.human.complete import complete

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
        code = exit_status(exc)
        if args.json:
            print_json_error(exc)
        else:
            from daemon.cli.human.errors import error_lines

            for line in error_lines(exc, args.command, getattr(args, "session_id", None)):
                print(line, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        return 130
    if args.command == "doctor":  # exit 1 when a check fails; text: one line per check
        from daemon.cli import doctor
        from daemon.config.platform import Check

        checks = [Check(c["name"], c["ok"], c["detail"], c["hint"]) for c in result["checks"]]
        print(json_line(result) if args.json else doctor.as_text(checks))
        return EXIT_OK if result["ok"] else EXIT_REFUSED
    if args.command == "agents" and not args.json:
        from daemon.cli.human.views import agents_lines

        print("\n".join(agents_lines(result, _term())))
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
        from daemon.cli.human.render import render

        render(args, result, sys.stdout, lambda op, a: call(sock_of(args), op, a, timeout=10.0))
    if args.command == "runtime" and result.get("state") != "succeeded":
        return EXIT_REFUSED
    return EXIT_OK
