"""Adoption against a listener that is not a kandev control server (a foreign process at the endpoint).

The foreign listener is a real Unix-socket server speaking our framing but answering ``identify``
without an identity or capability set; it records every op it receives.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from daemon.backend.recovery.adoption import Adopter
from daemon.host.paths import Paths
from daemon.store.db import Store, sqlite_url
from daemon.store.models import ControlServerRecord
from ipc.schema import Op, OpTable
from ipc.server import IpcServer

FOREIGN = OpTable("kandev-agentctl", (1, 0), [Op(n, auth=False) for n in
                  ("identify", "prove", "auth_begin", "auth_finish", "rotate", "ownership_shutdown", "stop_instance")])


def test_server_without_identity_is_unprovable_and_receives_nothing_else(short_tmp: Path):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.5, AC-EXECUTORS-CONTROL-OWNERSHIP-001.4,
    AC-EXECUTORS-CONTROL-OWNERSHIP-001.6: no identity or capability set → identity_mismatch (never
    'no answer'); nothing but identify is sent, not even a stop."""
    received: list[str] = []

    def handler(name: str):
        async def h(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            received.append(name)
            return {} if name == "identify" else {"ok": True}
        return h

    paths = Paths.for_home(short_tmp / "home")
    paths.ensure()
    store = Store.open(sqlite_url(paths.db_path))
    sock = str(paths.run_dir / "foreign.sock")

    async def run() -> Any:
        server = IpcServer(sock, FOREIGN, {n: handler(n) for n in FOREIGN.names})
        await server.start()
        try:
            adopter = Adopter(store, paths, "install", read_timeout_s=1.0, read_retries=0)
            record = ControlServerRecord(id=1, endpoint=sock, server_identity="recorded", credential_ref="x",
                                         capabilities=[], launch_mode="detached")
            return await adopter.adopt(record)
        finally:
            await server.close()

    try:
        adoption = asyncio.run(run())
    finally:
        store.close()
    assert (adoption.outcome, adoption.reason, adoption.answered) == ("refused", "identity_mismatch", True)
    assert received == ["identify"]
