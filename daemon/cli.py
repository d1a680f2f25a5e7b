"""``kandev``: the command-line client of the backend socket (design.md §8).

``kandev [--home DIR] [--json] COMMAND``. With ``--json`` every command prints
one JSON object on stdout. Exit codes: 0 ok, 1 refused by the backend (typed
error on stderr, or in the JSON as ``error``), 2 usage, 3 backend unreachable.
The CLI owns nothing: ``up`` only starts a backend process when no service
manager runs one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from daemon import doctor
from daemon.agents.registry import BUILTIN_AGENTS
from daemon.backend import api
from daemon.paths import Paths, resolve_home
from daemon.platform import Check
from ipc.client import SyncClient
from ipc.errors import ErrorCode, IpcError

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
UP_TIMEOUT_S = 400.0  # covers the longest accepted recovery deadline (5 min) plus start-up
DOWN_TIMEOUT_S = 60.0


class Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep the message format ours
        self.print_usage(sys.stderr)
        print(f"kandev: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kandev", description="Run and observe kandev agents.")
    p.add_argument("--home", help="Kandev home (default: $KANDEV_HOME, $STATE_DIRECTORY, ~/.local/share/kandev)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    up = sub.add_parser("up", help="start the backend in the background (no service manager)")
    up.add_argument("--config", help="config file for the backend")
    sub.add_parser("down", help="stop the backend gracefully")
    sub.add_parser("status", help="backend, capability, control server (running and installed versions), recovery")
    actl = sub.add_parser("agentctl", help="the control server").add_subparsers(
        dest="agentctl_cmd", required=True, parser_class=_Parser
    )
    actl.add_parser("reload", help="re-execute the control server's installed code in place; its agents keep"
                    " running (exit 1 if it refuses: the old code keeps serving)")

    task = sub.add_parser("task", help="tasks").add_subparsers(dest="task_cmd", required=True, parser_class=_Parser)
    tc = task.add_parser("create", help="create a task")
    tc.add_argument("--title", required=True)
    tc.add_argument("--workspace")
    tc.add_argument("--executor", choices=["local", "worktree"], default="local")
    tc.add_argument("--steps", help="workflow steps 'name[:reset][:prompt=TEXT],...' (e.g."
                    " 'plan,implement:reset:prompt=Implement it'); the first is entered at once")
    tp = task.add_parser("proceed", help="enter the task's next workflow step: its context reset, then its prompt")
    tp.add_argument("task_id")
    tw = task.add_parser("workflow", help="the task's workflow steps and where it is")
    tw.add_argument("task_id")

    session = sub.add_parser("session", help="sessions").add_subparsers(
        dest="session_cmd", required=True, parser_class=_Parser
    )
    ss = session.add_parser("start", help="start an agent session for a task")
    ss.add_argument("task_id")
    ss.add_argument("--agent", default="mock")
    ss.add_argument("--prompt")
    ss.add_argument("--passthrough", action="store_true")
    sh = session.add_parser("show", help="one session: state, agent, turns, transcript")
    sh.add_argument("session_id")
    session.add_parser("list", help="every session")
    sc = session.add_parser("configure", help="set the agent's model, mode and options (applied through the agent)")
    sc.add_argument("session_id")
    sc.add_argument("--model")
    sc.add_argument("--mode")
    sc.add_argument("--option", action="append", default=[], metavar="ID=VALUE", help="a config option (repeatable)")
    sr = session.add_parser("reset-context", help="a new provider session with model, mode and options restored")
    sr.add_argument("session_id")
    sr.add_argument("--restart", action="store_true",
                    help="restart the agent process instead of a new ACP session on the same process")

    rs = sub.add_parser("resume", help="give a session that lost its agent an agent again (session/load)")
    rs.add_argument("session_id")
    rs.add_argument("--fresh", action="store_true", help="start a new provider conversation (wipes the token)")

    pr = sub.add_parser("prompt", help="send a prompt to a session")
    pr.add_argument("session_id")
    pr.add_argument("text")
    pr.add_argument("--wait", action="store_true", help="wait for the turn to end")
    pe = sub.add_parser("permission", help="answer an agent's open permission request")
    pe.add_argument("session_id")
    pe.add_argument("request_id")
    choice = pe.add_mutually_exclusive_group(required=True)
    choice.add_argument("--option", help="the option id to choose (see session show: permissions)")
    choice.add_argument("--cancel", action="store_true", help="answer the request as cancelled")
    ca = sub.add_parser("cancel", help="cancel the current turn")
    ca.add_argument("session_id")
    sub.add_parser("board", help="tasks by bucket")
    doc = sub.add_parser("doctor", help="check this installation (no backend needed); exit 1 if a check fails")
    doc.add_argument("--config", help="config file to check (default: $KANDEV_CONFIG, /etc/kandev/kandev.toml)")
    sub.add_parser("agents", help="the built-in agents with package and pinned version")
    runtime = sub.add_parser("runtime", help="managed npm runtimes of the built-in agents").add_subparsers(
        dest="runtime_cmd", required=True, parser_class=_Parser
    )
    ru = runtime.add_parser(
        "update",
        help="prepare the agent's pinned npm package, repair its own npx cache entry once if that fails, "
        "then ACP-probe it (progress on stderr; exit 1 if the job fails)",
    )
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
    with SyncClient(str(socket), protocol_major=api.VERSION[0], timeout=5.0) as client:
        return client.call(op, args or {}, timeout=timeout)


def _print(result: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True, default=str))
        return
    if isinstance(result, dict):
        for key, value in result.items():
            if isinstance(value, (dict, list)):
                print(f"{key}: {json.dumps(value, default=str)}")
            else:
                print(f"{key}: {value}")
    else:
        print(result)


def _reachable(socket: Path) -> dict[str, Any] | None:
    try:
        return _call(socket, "status", timeout=5.0)
    except IpcError:
        return None


def cmd_up(paths: Paths, args: argparse.Namespace) -> dict[str, Any]:
    status = _reachable(paths.backend_socket)
    if status is not None and status["backend"]["state"] == "ready":
        return {"started": False, "pid": status["backend"]["pid"], "status": status}
    if status is None:
        paths.ensure()
        log_path = paths.logs_dir / "backend.log"
        argv = [sys.executable, "-m", "daemon.backend.main", "--home", str(paths.home)]
        if args.config:
            argv += ["--config", args.config]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                close_fds=True,
            )
    else:
        proc = None
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = (paths.logs_dir / "backend.log").read_text(errors="replace").splitlines()[-5:]
            raise IpcError(
                "backend_exited",
                f"backend exited with code {proc.returncode}: " + " | ".join(tail),
            )
        status = _reachable(paths.backend_socket)
        if status is not None and status["backend"]["state"] == "ready":
            return {"started": True, "pid": status["backend"]["pid"], "status": status}
        time.sleep(0.1)
    raise IpcError(ErrorCode.TIMEOUT, f"backend did not become ready within {UP_TIMEOUT_S:.0f}s")


def cmd_down(paths: Paths) -> dict[str, Any]:
    status = _call(paths.backend_socket, "status", timeout=10.0)
    pid = int(status["backend"]["pid"])
    result = _call(paths.backend_socket, "shutdown", timeout=10.0)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return {"stopped": True, "pid": pid, "detached": bool(result.get("detach"))}
        if _reachable(paths.backend_socket) is None and not Path(f"/proc/{pid}").exists():
            return {"stopped": True, "pid": pid, "detached": bool(result.get("detach"))}
        time.sleep(0.1)
    raise IpcError(ErrorCode.TIMEOUT, f"backend pid {pid} did not exit within {DOWN_TIMEOUT_S:.0f}s")


def run(args: argparse.Namespace) -> Any:
    paths = Paths.for_home(resolve_home(args.home))
    sock = paths.backend_socket
    cmd = args.command
    if cmd == "up":
        return cmd_up(paths, args)
    if cmd == "down":
        return cmd_down(paths)
    if cmd == "status":
        return _call(sock, "status")
    if cmd == "agentctl":  # reload: quiesce + preflight + exec, followed to its outcome
        return _call(sock, "agentctl_reload", timeout=200.0)
    if cmd == "task":
        if args.task_cmd == "proceed":
            return _call(sock, "task_proceed", {"task_id": args.task_id}, timeout=180.0)
        if args.task_cmd == "workflow":
            return _call(sock, "task_workflow", {"task_id": args.task_id})
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
        return _call(sock, "session_resume", {"session_id": args.session_id, "fresh": args.fresh}, timeout=180.0)
    if cmd == "session":
        if args.session_cmd == "start":
            call_args = {"task_id": args.task_id, "agent": args.agent, "passthrough": args.passthrough}
            if args.prompt:
                call_args["prompt"] = args.prompt
            return _call(sock, "session_start", call_args, timeout=120.0)
        if args.session_cmd == "show":
            return _call(sock, "session_show", {"session_id": args.session_id})
        if args.session_cmd == "configure":
            call_args = {"session_id": args.session_id, "options": _options(args.option)}
            if args.model is not None:
                call_args["model"] = args.model
            if args.mode is not None:
                call_args["mode"] = args.mode
            return _call(sock, "session_configure", call_args, timeout=180.0)
        if args.session_cmd == "reset-context":
            return _call(sock, "session_reset_context", {"session_id": args.session_id, "restart": args.restart},
                         timeout=180.0)
        return _call(sock, "session_list")
    if cmd == "prompt":
        return _call(
            sock,
            "prompt",
            {"session_id": args.session_id, "text": args.text, "wait": args.wait},
            timeout=None if args.wait else 60.0,
        )
    if cmd == "cancel":
        return _call(sock, "cancel", {"session_id": args.session_id})
    if cmd == "permission":
        call_args = {"session_id": args.session_id, "request_id": args.request_id}
        if args.option:
            call_args["option_id"] = args.option
        return _call(sock, "permission_respond", call_args)
    if cmd == "board":
        return _call(sock, "board")
    if cmd == "doctor":
        return doctor.as_json(doctor.run_doctor(paths, config_path=args.config))
    if cmd == "runtime":
        # Imported here: the runtime updater pulls in the ACP SDK, which would add ~0.5 s to every command.
        from daemon.runtimes.cli import runtime_update

        return runtime_update(lambda op, a, t: _call(sock, op, a, timeout=t), args.agent, sys.stderr)
    if cmd == "agents":
        return {"agents": [{"name": a.name, "package": a.package, "version": a.version}
                           for a in sorted(BUILTIN_AGENTS.values(), key=lambda a: a.name)]}
    raise Usage(f"unknown command {cmd}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except Usage as exc:
        print(f"kandev: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except IpcError as exc:
        code = EXIT_UNREACHABLE if exc.code == ErrorCode.UNAVAILABLE else EXIT_REFUSED
        if args.json:
            print(json.dumps({"error": exc.to_wire()}, sort_keys=True))
        print(f"kandev: {exc.code}: {exc.message}", file=sys.stderr)
        return code
    if args.command == "doctor":  # exit 1 when a check fails; text: one line per check
        checks = [Check(c["name"], c["ok"], c["detail"], c["hint"]) for c in result["checks"]]
        print(json.dumps(result, sort_keys=True) if args.json else doctor.as_text(checks))
        return EXIT_OK if result["ok"] else EXIT_REFUSED
    if args.command == "agents" and not args.json:
        for a in result["agents"]:
            print(f"{a['name']}\t{a['package']}\t{a['version']}")
        return EXIT_OK
    _print(result, args.json)
    if args.command == "runtime" and result.get("state") != "succeeded":
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
