"""``kandev __complete [--home DIR] sessions|tasks|requests SESSION``: ids for bash completion.

Prints one 8-character id per line (any unique prefix of 4+ characters is accepted back), asked
from the backend with short timeouts. When the backend is down, slow or refuses, it prints
nothing and exits 0: completion must never hang a shell or print errors into it.
"""

from __future__ import annotations

from typing import IO, Any

from daemon.api.version import VERSION as API_VERSION
from daemon.cli.human.fmt import short, unique_length
from daemon.host.home import backend_socket_path, resolve_home_dir
from ipc.client import SyncClient
from ipc.errors import IpcError

CONNECT_TIMEOUT_S = 0.5
CALL_TIMEOUT_S = 1.0


def _ids(client: SyncClient, what: str, rest: list[str]) -> list[str]:
    if what == "sessions":
        rows: list[Any] = client.call("session_list", {}, timeout=CALL_TIMEOUT_S)["sessions"]
        return [r["session_id"] for r in rows]
    if what == "tasks":
        return [t["task_id"] for t in client.call("task_list", {}, timeout=CALL_TIMEOUT_S)["tasks"]]
    if what == "requests" and rest:
        show = client.call("session_show", {"session_id": rest[0], "tail": 1}, timeout=CALL_TIMEOUT_S)
        return [p["request_id"] for p in show.get("permissions") or [] if p.get("state") == "open"]
    return []


def complete(argv: list[str], out: IO[str]) -> int:
    home = None
    if len(argv) >= 2 and argv[0] == "--home":
        home, argv = argv[1], argv[2:]
    if not argv:
        return 0
    try:
        socket = backend_socket_path(resolve_home_dir(home))
        with SyncClient(socket, protocol_major=API_VERSION[0], timeout=CONNECT_TIMEOUT_S) as client:
            ids = _ids(client, argv[0], argv[1:])
    except (IpcError, OSError, KeyError, TypeError, ValueError):
        return 0
    n = unique_length(ids) if ids else 8
    out.write("".join(short(i, n) + "\n" for i in ids))
    return 0
