"""The demo: an agent that keeps working while its backend is SIGKILLed and restarted.

``python -m daemon.cli.demo [--home DIR] [--keep]`` runs, with no service manager,
both daemons on SQLite with the mock agent and agent survival switched on:
a task and session, a ``/slow 20`` turn, ``kill -9`` of the backend after a
few chunks, a new backend, and then checks — through the ``kandev`` CLI only —
that the same agent process (same pid, same start time) kept streaming, was
re-tracked, and that the turn finished with all 20 chunks exactly once and in
order. Exits non-zero if any of that is not true. Then it stops everything it started (``kandev
down --agents``) and removes the home it made (unless ``--keep``; a ``--home`` given stays).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from daemon.host import process_start

CHUNKS = 20


class DemoFailed(RuntimeError):
    pass


def kandev(home: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    except json.JSONDecodeError:
        out = {}
    if proc.returncode != 0:
        raise DemoFailed(f"kandev {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return out


def wait(what: str, predicate: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(home: Path, keep: bool, remove_home: bool = False) -> int:
    env = dict(os.environ, KANDEV_FEATURES_AGENT_SURVIVAL="true")
    ctl_pid = None
    try:
        say(f"home {home}; agent survival switched on; no service manager")
        up = kandev(home, "up", env=env)
        st = up["status"]
        ctl_pid = st["control_server"]["pid"]
        say(f"backend pid {st['backend']['pid']}, control server pid {ctl_pid} ({st['control_server']['mode']})")
        task = kandev(home, "task", "create", "--title", "demo task", env=env)["task_id"]
        sid = kandev(home, "session", "start", task, "--agent", "mock", env=env)["session_id"]
        turn = kandev(home, "prompt", sid, f"/slow {CHUNKS}", env=env)["turn_id"]
        say(f"task {task}, session {sid}: prompt '/slow {CHUNKS}' started turn {turn}")
        def show() -> dict[str, Any]:
            return kandev(home, "session", "show", sid, env=env)

        before = wait("3 chunks", lambda: s if len(chunks(s := show())) >= 3 else None, 30)
        pid, start = before["agent_pid"], before["agent_pid_start_time"]
        backend_pid = st["backend"]["pid"]
        say(f"agent pid {pid} has streamed {len(chunks(before))} chunks; kill -9 backend {backend_pid}")
        os.kill(backend_pid, signal.SIGKILL)
        wait("backend exit", lambda: not psutil.pid_exists(backend_pid) or
             psutil.Process(backend_pid).status() == psutil.STATUS_ZOMBIE, 10)
        agent = psutil.Process(pid)
        if process_start.stamp(pid) != before["agent_pid_start_stamp"]:  # boot id and start ticks
            raise DemoFailed("agent pid was reused by another process")
        say(f"backend gone; agent pid {pid} still alive ({agent.status()}); waiting 3 s with no backend")
        time.sleep(3)  # the agent keeps producing chunks that the control server retains
        up2 = kandev(home, "up", env=env)
        adoption, recovery = up2["status"]["adoption"], up2["status"]["recovery"]
        say(f"new backend pid {up2['pid']}: control server {adoption['outcome']}"
            + (f" ({adoption['reason']})" if adoption.get("reason") else "")
            + f"; recovery re-tracked {recovery['retracked']}, not re-tracked {recovery['not_retracked']},"
            f" in {recovery['duration_ms']} ms")
        after = kandev(home, "session", "show", sid, env=env)
        say(f"session {sid}: state {after['state']}, retracked {after['retracked']}, "
            f"agent pid {after['agent_pid']} (start time {after['agent_pid_start_time']})")
        if not after["retracked"] or after["agent_pid"] != pid or after["agent_pid_start_time"] != start:
            raise DemoFailed("the session was not re-tracked onto the same agent process")
        say(f"{len(chunks(after)) - len(chunks(before))} chunks streamed while no backend ran were delivered")
        done = wait("turn end", lambda: s if (s := show())["state"] == "WAITING_FOR_INPUT" else None, CHUNKS + 30)
        got = chunks(done)
        expected = [f"{i}/{CHUNKS} " for i in range(1, CHUNKS + 1)]
        say(f"turn finished: {done['turns'][-1]['stop_reason']}; transcript has {len(got)} chunks")
        if got != expected:
            raise DemoFailed(f"transcript chunks differ from 1/{CHUNKS}..{CHUNKS}/{CHUNKS}: {got}")
        board = kandev(home, "board", env=env)
        if task not in board["turn_finished"]:
            raise DemoFailed(f"task not under turn_finished: {board}")
        say(f"all {CHUNKS} chunks exactly once and in order; board lists the task under turn_finished")
        say("OK: the same agent process kept streaming across a backend SIGKILL and the turn finished")
        return 0
    except DemoFailed as exc:
        say(f"FAILED: {exc}")
        return 1
    finally:
        if keep:
            say(f"kept running, its home is {home}: `kandev --home {home} down --agents` stops it")
        else:
            _stop(home, env, ctl_pid)
            if remove_home:  # a home the demo made itself: nothing of it is left behind
                shutil.rmtree(home, ignore_errors=True)
                say(f"stopped; its home {home} is removed")


def _stop(home: Path, env: dict[str, str], ctl_pid: int | None) -> None:
    """The backend, the control server and its agents, stopped; the control server waited for."""
    try:
        kandev(home, "down", "--agents", env=env)
    except DemoFailed:
        pass
    if ctl_pid:  # should `down --agents` have failed: stop the one we started
        try:
            server = psutil.Process(ctl_pid)
            server.terminate()
            server.wait(timeout=30)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kandev-demo", description=__doc__.splitlines()[0])
    p.add_argument("--home", help="Kandev home to use (default: a new directory under /var/tmp, removed at the"
                   " end unless --keep)")
    p.add_argument("--keep", action="store_true", help="leave the backend and agents running")
    args = p.parse_args(argv)
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="kandev-demo-", dir="/var/tmp"))
    home.mkdir(parents=True, exist_ok=True)
    return run(home, args.keep, remove_home=args.home is None)


if __name__ == "__main__":
    sys.exit(main())
