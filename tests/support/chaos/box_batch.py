"""Run inside the box (``python -m tests.support.chaos.box_batch HOME``): many backend calls and a
look at the process table in one process, so a chaos check costs one interpreter start, not one
per ``kandev`` command.

Reads ``{"calls": [[op, args, timeout], ...], "procs": bool}`` as JSON on stdin and prints
``{"results": [...], "procs": [...]}``: each result is ``{"ok": answer}`` or ``{"error": {"code",
"message"}}``; each process is ``{"pid", "pgid", "state", "unit", "mock"}`` (``unit``: the last part
of its cgroup in the named systemd hierarchy, e.g. ``kandev-agentctl.service``; ``mock``: its
command line runs the mock agent). Only the standard library and the CLI's own call are imported.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from daemon.cli.call import call
from daemon.host.paths import Paths
from ipc.errors import IpcError


def _unit(pid: str) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3 and parts[1] == "name=systemd":
                return parts[2].rstrip("/").rsplit("/", 1)[-1]
    return ""


def processes() -> list[dict[str, Any]]:
    """Every process of the box (one that ends meanwhile is left out)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append({"pid": int(pid), "pgid": int(fields[2]), "state": fields[0], "unit": _unit(pid),
                          "mock": "daemon.agents.mock" in cmdline})
        except (OSError, ValueError, IndexError):
            continue
    return found


def main() -> None:
    request = json.load(sys.stdin)
    socket = Paths.for_home(sys.argv[1]).backend_socket
    results: list[dict[str, Any]] = []
    for op, args, timeout in request.get("calls", []):
        try:
            results.append({"ok": call(socket, op, args, timeout=timeout)})
        except IpcError as exc:
            results.append({"error": {"code": exc.code, "message": exc.message}})
        except OSError as exc:
            results.append({"error": {"code": "unavailable", "message": str(exc)}})
    out = {"results": results, "procs": processes() if request.get("procs") else []}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
