"""Adoption of a control server that begins a reload between ``identify`` and ``prove``.

Found by the reload chaos test (Issue 15 scenario D): a backend restarted while its control server
re-executed answered ``identify``, then had its handshake refused with ``reloading`` and took that
for a failed proof. It refused the server (``authentication_failure``), started another one and
left both sessions RUNNING on agents nobody read. A ``reloading`` answer is the server saying "ask
again in a moment"; a proof that does not match is still refused at once.

The server here is a stand-in on a real Unix socket speaking our framing and the real proofs
(``daemon.agentctl.auth``), so that its ``prove`` can answer ``reloading`` exactly once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from daemon.agentctl import auth, launch
from daemon.agentctl.protocol import REQUIRED_CAPABILITIES
from daemon.backend.recovery.adoption import Adopter
from daemon.host.paths import Paths
from daemon.store.db import Store, sqlite_url
from daemon.store.models import ControlServerRecord
from ipc.errors import ErrorCode, IpcError
from ipc.schema import Op, OpTable
from ipc.server import IpcServer

IDENTITY = "5e" * 16
INSTALLATION = "install-1"
TABLE = OpTable("kandev-agentctl", (1, 2), [
    Op("identify", auth=False), Op("prove", optional={"challenge": bytes}, auth=False),
    Op("auth_begin", auth=False), Op("auth_finish", optional={"proof": bytes}, auth=False),
    Op("rotate", optional={"proof": bytes}, auth=False), Op("confirm_rotation", optional={"rotation_id": int}, auth=False),
])


class StandIn:
    """A control server that proves ``provable`` credentials and answers the first ``reloading_proves``
    ``prove`` requests with ``reloading``."""

    def __init__(self, provable: list[bytes], reloading_proves: int) -> None:
        self.provable = provable
        self.reloading_proves = reloading_proves
        self.received: list[str] = []

    def handlers(self) -> dict[str, Any]:
        async def identify(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("identify")
            return {"server_identity": IDENTITY, "capabilities": list(REQUIRED_CAPABILITIES),
                    "protocol_version": [1, 2], "unowned_period_s": 600.0}

        async def prove(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("prove")
            if self.reloading_proves > 0:
                self.reloading_proves -= 1
                raise IpcError(ErrorCode.RELOADING, "the control server is re-executing")
            return {"proofs": [auth.server_proof(c, args["challenge"], IDENTITY, INSTALLATION) for c in self.provable]}

        async def auth_begin(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("auth_begin")
            return {"nonce": auth.new_challenge()}

        async def auth_finish(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("auth_finish")
            return {"credential": "current"}

        async def rotate(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("rotate")
            new = auth.new_credential()
            self.provable.append(new)
            return {"rotation_id": 1, "credential": new, "replay": False}

        async def confirm_rotation(ctx: Any, args: dict[str, Any]) -> dict[str, Any]:
            self.received.append("confirm_rotation")
            return {"rotation_id": 1, "changed": True}

        return {"identify": identify, "prove": prove, "auth_begin": auth_begin, "auth_finish": auth_finish,
                "rotate": rotate, "confirm_rotation": confirm_rotation}


def _adopt(root: Path, stand_in: StandIn, stored: bytes) -> Any:
    paths = Paths.for_home(root / "home")
    paths.ensure()
    launch.write_credential(paths.secrets_dir / "cred-old", stored)
    store = Store.open(sqlite_url(paths.db_path))
    sock = str(paths.run_dir / "agentctl.sock")
    with store.session() as db:
        db.add(ControlServerRecord(id=1, endpoint=sock, server_identity=IDENTITY, credential_ref="cred-old",
                                   capabilities=list(REQUIRED_CAPABILITIES), launch_mode="detached"))

    async def scenario() -> Any:
        server = IpcServer(sock, TABLE, stand_in.handlers())
        await server.start()
        try:
            adopter = Adopter(store, paths, INSTALLATION, read_timeout_s=2.0, read_retries=0)
            with store.session() as db:
                record = db.get_one(ControlServerRecord, 1)
                db.expunge(record)
            adoption = await adopter.adopt(record)
            if adoption.client is not None:
                await adoption.client.close()
            return adoption
        finally:
            await server.close()

    try:
        return asyncio.run(scenario())
    finally:
        store.close()


def test_a_reload_between_identify_and_prove_is_waited_for_not_refused(short_tmp: Path) -> None:
    """Issue 15 scenario D (found by it): ``reloading`` in the handshake is asked again, not taken
    for a failed proof; the adoption then proves, rotates and confirms as usual."""
    credential = auth.new_credential()
    stand_in = StandIn([credential], reloading_proves=2)
    adoption = _adopt(short_tmp, stand_in, credential)
    assert (adoption.outcome, adoption.reason) == ("adopted", None), stand_in.received
    assert stand_in.received[:5] == ["identify", "identify", "prove", "identify", "prove"]
    assert "rotate" in stand_in.received and stand_in.received[-1] == "confirm_rotation"


def test_a_proof_that_does_not_match_is_still_refused_at_once(short_tmp: Path) -> None:
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.10: a server that cannot prove our credential is refused
    with ``authentication_failure`` after one ``prove``; nothing else is sent."""
    stand_in = StandIn([auth.new_credential()], reloading_proves=0)
    adoption = _adopt(short_tmp, stand_in, auth.new_credential())
    assert (adoption.outcome, adoption.reason) == ("refused", "authentication_failure")
    assert stand_in.received == ["identify", "identify", "prove"]
