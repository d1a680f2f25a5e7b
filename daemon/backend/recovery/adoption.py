"""Adoption: take over a surviving control server only when it is provably ours.

``Adopter.adopt(record)`` runs the gate of docs/requirements.md#control-server-ownership in its order, the
first failure deciding the one refusal reason (AC-EXECUTORS-CONTROL-OWNERSHIP-001.6):

1. no answer at the recorded endpoint (or none recorded) → start fresh
2. identity mismatch (or none advertised) → refuse, send nothing else
3. credential unavailable (stored secret unreadable) → refuse, keep the secret
4. authentication failure (the server cannot prove it holds our credential) → refuse
5. capability incompatibility → stop it with ownership_shutdown, then start fresh
6. credential rotation failure → adoption incomplete, nothing recovered

then rotates the credential: ``rotate`` → the new secret and the record's
credential reference written durably → ``confirm_rotation`` with the new
credential (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7; confirming early is the one
forbidden order). Fault points sit between those steps so tests can kill the
backend at each one.

A server that cannot be proven ours is never stopped and never sent a
credential (AC-EXECUTORS-CONTROL-OWNERSHIP-001.4, AC-EXECUTORS-CONTROL-OWNERSHIP-001.10). ``shutdown_own`` is the destroy-only path used when
the capability is off but a provable server from an earlier launch still runs
(AC-EXECUTORS-SURVIVAL-005.5): it accepts the superseded credential and needs
no adoption (AC-EXECUTORS-CONTROL-OWNERSHIP-002.9).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from daemon.agentctl import launch as launch_file
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import RELOAD_WINDOW_S, OwnershipRefused, identify, reload_seen_recently
from daemon.agentctl.client.replies import ServerIdentity
from daemon.agentctl.protocol import REQUIRED_CAPABILITIES
from daemon.api.ops import AdoptionOutcome
from daemon.backend.cluster.identity import ClusterIdentity
from daemon.core import faults
from daemon.host.paths import Paths
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

# An adoption step in flight when the recovery deadline elapses is allowed to finish, never
# cancelled (AC-EXECUTORS-SURVIVAL-003.7); this only bounds a server that never answers at all.
ADOPTION_STEP_TIMEOUT_S = 360.0
RELOAD_RETRY_PAUSE_S = 0.05
"""Pause before asking again a server that answered ``reloading`` (it re-executes within seconds)."""





@dataclass
class Adoption:
    """The outcome of one adoption attempt.

    ``outcome``: ``adopted``; ``no_server`` (nothing recorded, nothing answered,
    or the server is shutting down — none of these is a refusal); ``refused``
    (with one ``reason``); ``disabled`` (no attempt: capability off).
    ``answered``: a server answered at the recorded endpoint (AC-EXECUTORS-SURVIVAL-003.6 rule 7).
    ``stopped``: this backend stopped that server (incompatible, or disabled cleanup).
    """

    outcome: AdoptionOutcome
    reason: str | None = None
    client: AgentctlClient | None = None
    record: ControlServerRecord | None = None
    answered: bool = False
    stopped: bool = False
    stop_failed: bool = False


class Adopter:
    def __init__(
        self,
        store: Store,
        paths: Paths,
        installation_id: str,
        *,
        read_timeout_s: float,
        read_retries: int,
        on_claim_ready: Callable[[AgentctlClient, bytes], None] | None = None,
        identity: ClusterIdentity | None = None,
    ) -> None:
        self.identity = identity or ClusterIdentity()  # whose control-server record (Issue 47)
        self.store = store
        self.paths = paths
        self.installation_id = installation_id
        self.read_timeout_s = read_timeout_s
        self.read_retries = read_retries
        self.on_claim_ready = on_claim_ready

    # ------------------------------------------------------------ helpers
    def read_credential(self, ref: str | None) -> bytes:
        if not ref or "/" in ref or ref.startswith("."):
            raise ValueError(f"invalid credential reference {ref!r}")
        try:
            return launch_file.read_credential_file(self.paths.secrets_dir / ref)
        except launch_file.LaunchError as exc:
            raise ValueError(str(exc)) from None

    async def budget(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Timeout T, R retries, no pause between attempts (AC-EXECUTORS-SURVIVAL-002.13).

        An attempt that failed while the server said it is re-executing (``reloading``, within
        ``RELOAD_WINDOW_S``) is not counted: the server is alive and back in a moment (Issue 15)."""
        last: Exception | None = None
        attempts = 0
        loop = asyncio.get_running_loop()
        reload_deadline: float | None = None
        while attempts < self.read_retries + 1:
            try:
                return await within(fn(), timeout=self.read_timeout_s)
            except TimeoutError as exc:
                last = exc
            except IpcError as exc:
                if exc.code not in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.RELOADING):
                    raise
                last = exc
            if reload_seen_recently() or (isinstance(last, IpcError) and last.code == ErrorCode.RELOADING):
                reload_deadline = reload_deadline or loop.time() + RELOAD_WINDOW_S
                if loop.time() < reload_deadline:
                    await asyncio.sleep(RELOAD_RETRY_PAUSE_S)  # the re-exec takes a second or so
                    continue
            attempts += 1
        raise IpcError(ErrorCode.TIMEOUT, f"no answer after {self.read_retries + 1} attempts: {last}")

    async def _identify(self, endpoint: str) -> tuple[bool, dict[str, Any] | None]:
        """(answered, identity). A listener that answers with an error has answered."""
        try:
            info = await self.budget(lambda: _identify_or_raise(endpoint, self.read_timeout_s))
        except IpcError as exc:
            if exc.code == ErrorCode.TIMEOUT:
                return False, None
            return True, None
        return True, info

    async def _prove(self, record: ControlServerRecord, credential: bytes) -> AgentctlClient:
        """identify → the server proves it holds our credential → authenticate; the superseded
        credential is accepted here because only rotate and ownership_shutdown may follow (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7, AC-EXECUTORS-CONTROL-OWNERSHIP-002.9)."""
        return await AgentctlClient.connect(
            record.endpoint,
            credential=credential,
            installation_id=self.installation_id,
            expected_identity=record.server_identity,
            timeout=self.read_timeout_s,
            purpose="adopt",
        )

    # -------------------------------------------------------------- adopt
    async def adopt(self, record: ControlServerRecord | None) -> Adoption:
        # 1. no answer
        if record is None or not record.endpoint:
            return Adoption(AdoptionOutcome.NO_SERVER, None)
        answered, info = await self._identify(record.endpoint)
        if not answered:
            return Adoption(AdoptionOutcome.NO_SERVER, "no_answer", record=record)
        # 2. identity (a server advertising no identity or capabilities is unprovable, AC-EXECUTORS-CONTROL-OWNERSHIP-001.5)
        if not info or not info.get("server_identity") or not info.get("capabilities"):
            return Adoption(AdoptionOutcome.REFUSED, "identity_mismatch", record=record, answered=True)
        if info["server_identity"] != record.server_identity:
            return Adoption(AdoptionOutcome.REFUSED, "identity_mismatch", record=record, answered=True)
        # 3. credential unavailable: nothing is sent, the secret is kept (AC-EXECUTORS-CONTROL-OWNERSHIP-001.9)
        try:
            credential = self.read_credential(record.credential_ref)
        except (OSError, ValueError) as exc:
            log.warning("stored control-server credential unreadable: %s", exc)
            return Adoption(AdoptionOutcome.REFUSED, "credential_unavailable", record=record, answered=True)
        # 4. authentication: the server proves possession first (AC-EXECUTORS-CONTROL-OWNERSHIP-001.10).
        # On the read budget, as identify was: a server that began a reload since it answered
        # identify refuses the handshake with ``reloading``, which is not a failed proof.
        try:
            client = await self.budget(lambda: self._prove(record, credential))
        except OwnershipRefused as exc:
            return Adoption(AdoptionOutcome.REFUSED, exc.reason, record=record, answered=True)
        except IpcError as exc:
            if exc.code == ErrorCode.SHUTTING_DOWN:
                return Adoption(AdoptionOutcome.NO_SERVER, None, record=record, answered=True)
            return Adoption(AdoptionOutcome.REFUSED, "authentication_failure", record=record, answered=True)
        # 5. capabilities: set inclusion, never version ordering (AC-EXECUTORS-CONTROL-OWNERSHIP-004.2)
        missing = set(REQUIRED_CAPABILITIES) - set(client.capabilities)
        if missing:
            log.warning("control server lacks capabilities %s", sorted(missing))
            stopped = await self._shutdown(client)
            return Adoption(
                AdoptionOutcome.REFUSED,
                "capability_incompatibility",
                record=record,
                answered=True,
                stopped=stopped,
                stop_failed=not stopped,
            )
        # 6. rotation
        return await self._rotate(client, record)

    async def _rotate(self, client: AgentctlClient, record: ControlServerRecord) -> Adoption:
        try:
            rotation_id, new_credential = await client.rotate(timeout=ADOPTION_STEP_TIMEOUT_S)
        except IpcError as exc:
            await client.close()
            if exc.code == ErrorCode.SHUTTING_DOWN:  # the one-way door: treat as no server (AC-EXECUTORS-CONTROL-OWNERSHIP-003.9)
                return Adoption(AdoptionOutcome.NO_SERVER, None, record=record, answered=True)
            return Adoption(AdoptionOutcome.REFUSED, "credential_rotation_failure", record=record, answered=True)
        faults.hit("adopt_after_rotate")
        old_ref = record.credential_ref
        new_ref = f"agentctl-cred-{secrets.token_hex(6)}"
        try:
            # Both writes durable before confirm; either order recovers (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7).
            launch_file.write_credential(self.paths.secrets_dir / new_ref, new_credential)
            faults.hit("adopt_after_secret")
            with self.store.session() as db:
                stored = self.identity.record(db)
                if stored is None:
                    raise RuntimeError("control-server record vanished during adoption")
                stored.credential_ref = new_ref
                stored.updated_at = datetime.now(UTC)
            faults.hit("adopt_after_record")
        except Exception as exc:
            log.error("could not persist the rotated credential: %s", exc)
            await client.close()
            return Adoption(AdoptionOutcome.REFUSED, "credential_rotation_failure", record=record, answered=True)
        await client.close()
        try:
            current = await self._connect_to_confirm(record, new_credential)
            await current.confirm_rotation(rotation_id, timeout=ADOPTION_STEP_TIMEOUT_S)
        except (IpcError, OwnershipRefused) as exc:
            log.error("confirming rotation %s failed: %s", rotation_id, exc)
            return Adoption(AdoptionOutcome.REFUSED, "credential_rotation_failure", record=record, answered=True)
        faults.hit("adopt_after_confirm")
        if self.on_claim_ready is not None:  # the claim loop starts now, not after re-tracking (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8)
            self.on_claim_ready(current, new_credential)
        if old_ref and old_ref != new_ref:
            with contextlib.suppress(OSError):
                (self.paths.secrets_dir / old_ref).unlink()
        record.credential_ref = new_ref
        return Adoption(AdoptionOutcome.ADOPTED, None, client=current, record=record, answered=True)

    async def _connect_to_confirm(self, record: ControlServerRecord, credential: bytes) -> AgentctlClient:
        """The connection that confirms the rotation. The server answered the rotate a moment ago, so
        a connection it accepts but does not answer yet is a re-exec under way (Issue 15): retried on
        timeouts for up to ``RELOAD_WINDOW_S``; a refused connection still fails at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELOAD_WINDOW_S
        while True:
            try:
                return await AgentctlClient.connect(
                    record.endpoint,
                    credential=credential,
                    installation_id=self.installation_id,
                    expected_identity=record.server_identity,
                    timeout=self.read_timeout_s,
                )
            except IpcError as exc:
                if exc.code not in (ErrorCode.TIMEOUT, ErrorCode.RELOADING) or loop.time() >= deadline:
                    raise
                log.info("confirming rotation: the control server does not answer yet (%s); retrying", exc.code)

    async def _shutdown(self, client: AgentctlClient) -> bool:
        """ownership_shutdown on the read budget; already stopping/absent counts as success (AC-EXECUTORS-CONTROL-OWNERSHIP-004.7)."""
        try:
            await self.budget(client.ownership_shutdown)
            return True
        except IpcError as exc:
            if exc.code in (ErrorCode.SHUTTING_DOWN, ErrorCode.UNAVAILABLE):
                return True
            log.error("ownership_shutdown failed: %s", exc)
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.close()

    async def shutdown_own(self, record: ControlServerRecord | None) -> Adoption:
        """Capability off: stop a provably-own survivor from an earlier launch (AC-EXECUTORS-SURVIVAL-005.5)."""
        if record is None or not record.endpoint:
            return Adoption(AdoptionOutcome.DISABLED, None)
        answered, info = await self._identify(record.endpoint)
        if not answered:
            return Adoption(AdoptionOutcome.DISABLED, None, record=record)
        if not info or info.get("server_identity") != record.server_identity:
            return Adoption(AdoptionOutcome.DISABLED, "identity_mismatch", record=record, answered=True)
        try:
            credential = self.read_credential(record.credential_ref)
        except (OSError, ValueError):
            return Adoption(AdoptionOutcome.DISABLED, "credential_unavailable", record=record, answered=True)
        try:
            client = await self.budget(lambda: self._prove(record, credential))
        except OwnershipRefused as exc:
            return Adoption(AdoptionOutcome.DISABLED, exc.reason, record=record, answered=True)
        except IpcError:
            return Adoption(AdoptionOutcome.DISABLED, "authentication_failure", record=record, answered=True)
        stopped = await self._shutdown(client)
        return Adoption(
            AdoptionOutcome.DISABLED,
            None if stopped else "stop_failed",
            record=record,
            answered=True,
            stopped=stopped,
            stop_failed=not stopped,
        )


async def _identify_or_raise(endpoint: str, timeout: float) -> ServerIdentity:
    info = await identify(endpoint, timeout=timeout)
    if info is None:
        raise IpcError(ErrorCode.UNAVAILABLE, "no answer")
    return info
