"""The reload status a control server reports: ``server_info``'s answer and the status file.

Owns the ``{version, pid, reload: {...history, in_progress}}`` document and its 0600 file beside
the socket (``<socket>.reload.json``), which ``kandev-agentctl --reload`` (no credential:
``daemon.agentctl.reload.client``) follows to the reload's end. The history itself is
``daemon.agentctl.handover.ReloadHistory``, kept in ``ServerContext``; the re-exec is
``daemon.agentctl.reload.reexec``'s.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from daemon.agentctl.handover import to_plain
from daemon.agentctl.server_context import ServerContext
from daemon.core.version import VERSION

log = logging.getLogger("kandev.agentctl.server")


def status(server: ServerContext) -> dict[str, Any]:
    """``{version, pid, reload: {...history, in_progress}}``: ``server_info`` and the status file."""
    history = to_plain(server.reload_history)
    history["in_progress"] = server.reloader is not None and server.reloader.in_progress
    return {"version": VERSION, "pid": os.getpid(), "reload": history}


def status_path(server: ServerContext) -> Path:
    """Where the reload status is written for ``kandev-agentctl --reload`` (which holds no
    credential): beside the socket, in the server's private run directory."""
    return Path(server.config.socket_path + ".reload.json")  # reload_client.STATUS_SUFFIX


def write(server: ServerContext) -> None:
    """Rewrite the status file (small, atomic); a failure is logged, never fatal."""
    path = status_path(server)
    data = json.dumps(status(server), sort_keys=True).encode("utf-8") + b"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write the reload status file %s: %s", path, exc)
