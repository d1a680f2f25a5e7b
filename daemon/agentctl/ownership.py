"""The control server's ownership state: credentials, rotation, and the unowned timer.

A pure state machine (no sockets, injectable clock and credential source), so
every rule of REQ-EXECUTORS-CONTROL-OWNERSHIP-002 and REQ-EXECUTORS-CONTROL-OWNERSHIP-003 is
unit-testable; ``daemon.agentctl.server`` maps its refusals onto the wire.

Credentials (docs/architecture.md#ownership). Each credential has an id: the rotation id that issued
it; the launch credential C_0 has id 0 and starts **confirmed(0)**.

- ``rotate`` presented with C_n, the credential of the highest rotation n
  (confirmed or not): allocate n+1 with a fresh 32-byte credential. The
  acceptable set becomes {C_{n+1} full power, C_n superseded}; every older
  credential authenticates nothing, including an earlier unconfirmed
  replacement (AC-EXECUTORS-CONTROL-OWNERSHIP-002.8).
- ``rotate`` presented with the credential the highest, still unconfirmed,
  rotation superseded: the idempotent replay. The SAME (rotation id,
  credential) comes back; no id is drawn and the set is unchanged (AC-EXECUTORS-CONTROL-OWNERSHIP-002.10).
- Anything else is refused. Rotation ids strictly increase (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6).
- ``confirm(k)``: k = the highest id and unconfirmed -> confirmed; the
  superseded credential then authenticates nothing (AC-EXECUTORS-CONTROL-OWNERSHIP-002.1, AC-EXECUTORS-CONTROL-OWNERSHIP-002.7 phase 2) and
  the server closes every connection and stream authenticated under it
  (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2). k below the highest, or a repeated confirmation: accepted, no
  effect (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6). An id never issued: ``unknown_rotation``, nothing changes.
- A superseded credential is good only for the purposes ``rotate`` and
  ``ownership_shutdown`` (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7, AC-EXECUTORS-CONTROL-OWNERSHIP-002.9); anything else gets
  ``superseded_credential``, as does any use of a credential that no longer
  authenticates anything.

Unowned timer. ``last_renewal`` starts at process start (a spawn whose
handshake never completes counts from there, AC-EXECUTORS-CONTROL-OWNERSHIP-003.8) on ``time.monotonic()``
(CLOCK_MONOTONIC: it does not advance during system suspend, so a suspended
host does not count as unowned time). Exactly three things renew it (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8):
``claim``, a successful rotation (a replay included), and the bootstrap
handshake. Reading of the bootstrap here: the launch credential is written by
the starter, so the server mints nothing; the **first successful connection
authentication with the launch credential** (while no rotation has happened)
is the bootstrap handshake and renews once. Instance operations, streams and
enumeration never renew. Expiry: ``now - last_renewal >= period`` (AC-EXECUTORS-CONTROL-OWNERSHIP-003.2,
AC-EXECUTORS-CONTROL-OWNERSHIP-003.3). The shutdown decision is a one-way latch (AC-EXECUTORS-CONTROL-OWNERSHIP-003.9): afterwards claim,
rotate and confirm are refused with ``shutting_down``; a claim accepted
strictly before the decision moved ``last_renewal`` and so prevents it.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from daemon.agentctl import auth
from daemon.agentctl.handover import OwnershipHandover
from ipc.errors import ErrorCode, IpcError

CURRENT = "current"
"""The credential of the highest rotation: full power."""
SUPERSEDED = "superseded"
"""The credential the highest, unconfirmed rotation replaced: adoption and shutdown only."""

SUPERSEDED_PURPOSES = frozenset({"rotate", "ownership_shutdown"})
"""What a superseded credential may still do (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7, AC-EXECUTORS-CONTROL-OWNERSHIP-002.9)."""

LAUNCH_CREDENTIAL_ID = 0


@dataclass(frozen=True)
class Rotation:
    """The answer to a successful ``rotate``."""

    rotation_id: int
    credential: bytes
    replay: bool
    cut: frozenset[int]
    """Credential ids that authenticated something before and nothing now."""


@dataclass(frozen=True)
class Confirmation:
    """The answer to an accepted ``confirm``."""

    rotation_id: int
    changed: bool
    cut: frozenset[int]
    """Credential ids whose connections and streams the server must close (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2)."""


class Ownership:
    """Credentials, rotation and the unowned timer of one control-server launch."""

    def __init__(
        self,
        launch_credential: bytes,
        period_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        new_credential: Callable[[], bytes] = auth.new_credential,
    ) -> None:
        if not isinstance(launch_credential, bytes) or len(launch_credential) != auth.CREDENTIAL_BYTES:
            raise ValueError(f"the launch credential must be {auth.CREDENTIAL_BYTES} bytes")
        if not period_s > 0:
            raise ValueError("the unowned period must be positive")
        self.period_s = float(period_s)
        self._clock = clock
        self._new_credential = new_credential
        # Only acceptable credentials are kept: {highest} or {highest, highest - 1}.
        self._credentials: dict[int, bytes] = {LAUNCH_CREDENTIAL_ID: launch_credential}
        self.highest = LAUNCH_CREDENTIAL_ID
        self.confirmed = True
        self.bootstrapped = False
        self.started_at = clock()
        self.last_renewal = self.started_at
        self.shutting_down = False
        self.shutdown_reason: str | None = None

    # -- re-exec hand-over (daemon.agentctl.handover) --------------------------------

    def snapshot(self) -> OwnershipHandover:
        """Everything of this state, for the next process image (the credentials themselves too:
        they travel only in the hand-over memfd). Not while shutting down: that latch ends the
        lifetime, a reload never carries it."""
        if self.shutting_down:
            raise RuntimeError("a shutting-down server is not handed over")
        return OwnershipHandover(
            credentials=[[cred_id, cred] for cred_id, cred in sorted(self._credentials.items())],
            highest=self.highest,
            confirmed=self.confirmed,
            bootstrapped=self.bootstrapped,
            started_at=self.started_at,
            last_renewal=self.last_renewal,
            period_s=self.period_s,
        )

    @classmethod
    def from_snapshot(
        cls,
        snap: OwnershipHandover,
        *,
        clock: Callable[[], float] = time.monotonic,
        new_credential: Callable[[], bytes] = auth.new_credential,
    ) -> Ownership:
        """The ownership state of the previous process image. ``started_at`` and ``last_renewal``
        are CLOCK_MONOTONIC values: one clock per boot, so the unowned timer goes on unchanged."""
        credentials = {int(cred_id): bytes(cred) for cred_id, cred in snap.credentials}
        if snap.highest not in credentials or not 1 <= len(credentials) <= 2:
            raise ValueError("the handed-over credentials do not include the highest rotation's")
        owner = cls(credentials[snap.highest], snap.period_s, clock=clock, new_credential=new_credential)
        owner._credentials = credentials
        owner.highest = snap.highest
        owner.confirmed = snap.confirmed
        owner.bootstrapped = snap.bootstrapped
        owner.started_at = snap.started_at
        owner.last_renewal = snap.last_renewal
        return owner

    # -- credentials -----------------------------------------------------------

    def role(self, cred_id: int | None) -> str | None:
        """``current``, ``superseded`` or None (authenticates nothing) for a credential id."""
        if cred_id is None:
            return None
        if cred_id == self.highest:
            return CURRENT
        if cred_id == self.highest - 1 and not self.confirmed:
            return SUPERSEDED
        return None

    def acceptable_ids(self) -> frozenset[int]:
        return frozenset(self._credentials)

    def current_credential(self) -> bytes:
        """The credential with the highest id: the one a re-executed server starts with."""
        return self._credentials[self.highest]

    def allows(self, cred_id: int | None, purpose: str) -> bool:
        role = self.role(cred_id)
        return role == CURRENT or (role == SUPERSEDED and purpose in SUPERSEDED_PURPOSES)

    def check(self, cred_id: int | None, purpose: str) -> str:
        """The role of ``cred_id`` if it may be used for ``purpose``; else raise ``superseded_credential``."""
        role = self.role(cred_id)
        if role == CURRENT or (role == SUPERSEDED and purpose in SUPERSEDED_PURPOSES):
            return role
        if role == SUPERSEDED:
            detail = "was superseded by a rotation: it may only rotate or shut the server down"
        else:
            detail = "was superseded and no longer authenticates anything"
        raise IpcError(ErrorCode.SUPERSEDED_CREDENTIAL, f"{purpose}: the credential of this connection {detail}")

    def _find(self, matches: Callable[[bytes], bool]) -> int | None:
        """The id of the acceptable credential ``matches`` accepts; every candidate is tried."""
        found: int | None = None
        for cred_id, credential in self._credentials.items():
            if matches(credential):
                found = cred_id
        return found

    def authenticate(self, credential: object, purpose: str) -> str | None:
        """Which slot ``credential`` (the raw bytes) fills for ``purpose``: ``current``,
        ``superseded`` or None. Constant-time comparisons against every acceptable credential."""
        if not isinstance(credential, bytes | bytearray):
            return None
        cred_id = self._find(lambda c: hmac.compare_digest(c, bytes(credential)))
        return self.role(cred_id) if self.allows(cred_id, purpose) else None

    def match_connection_proof(self, nonce: bytes, server_identity: str, proof: object) -> int | None:
        """The credential id whose ``auth.connection_proof`` over ``nonce`` equals ``proof``, or None."""
        return self._find(lambda c: auth.verify(auth.connection_proof(c, nonce, server_identity), proof))

    def prove(self, challenge: bytes, server_identity: str, installation_id: str) -> list[bytes]:
        """``auth.server_proof`` for each acceptable credential (at most two), the current one first."""
        return [
            auth.server_proof(self._credentials[cred_id], challenge, server_identity, installation_id)
            for cred_id in sorted(self._credentials, reverse=True)
        ]

    # -- rotation ----------------------------------------------------------------

    def rotate_as(self, cred_id: int | None) -> Rotation:
        """Rotate, presented with the credential of id ``cred_id`` (see the module doc)."""
        self.check(cred_id, "rotate")
        self._refuse_if_shutting_down("rotate")
        if cred_id == self.highest:
            new_id = self.highest + 1
            credential = self._new_credential()
            if not isinstance(credential, bytes) or len(credential) != auth.CREDENTIAL_BYTES:
                raise ValueError("the credential source returned a malformed credential")
            before = self.acceptable_ids()
            self._credentials = {new_id: credential, self.highest: self._credentials[self.highest]}
            self.highest = new_id
            self.confirmed = False
            self._renew()
            return Rotation(new_id, credential, replay=False, cut=before - self.acceptable_ids())
        # role() said superseded: the highest rotation is unconfirmed and replaced this one (AC-EXECUTORS-CONTROL-OWNERSHIP-002.10).
        self._renew()
        return Rotation(self.highest, self._credentials[self.highest], replay=True, cut=frozenset())

    def rotate(self, credential: object) -> Rotation:
        """Rotate, presented with the raw credential; refused (``unauthenticated``) if it is not acceptable."""
        cred_id = None
        if isinstance(credential, bytes | bytearray):
            cred_id = self._find(lambda c: hmac.compare_digest(c, bytes(credential)))
        if cred_id is None:
            raise IpcError(ErrorCode.UNAUTHENTICATED, "rotate: the credential is not acceptable")
        return self.rotate_as(cred_id)

    def confirm(self, rotation_id: int) -> Confirmation:
        """Confirm that the replacement of ``rotation_id`` is durably stored (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6, AC-EXECUTORS-CONTROL-OWNERSHIP-002.7)."""
        if isinstance(rotation_id, bool) or not isinstance(rotation_id, int) or rotation_id < 0:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, "confirm_rotation: 'rotation_id' must be a whole number >= 0")
        if rotation_id > self.highest:
            raise IpcError(
                ErrorCode.UNKNOWN_ROTATION,
                f"confirm_rotation: rotation {rotation_id} was never issued (highest is {self.highest})",
            )
        self._refuse_if_shutting_down("confirm_rotation")
        if rotation_id < self.highest or self.confirmed:
            return Confirmation(rotation_id, changed=False, cut=frozenset())
        before = self.acceptable_ids()
        self._credentials = {self.highest: self._credentials[self.highest]}
        self.confirmed = True
        return Confirmation(rotation_id, changed=True, cut=before - self.acceptable_ids())

    # -- the unowned timer ----------------------------------------------------------

    def _refuse_if_shutting_down(self, op: str) -> None:
        if self.shutting_down:
            raise IpcError(ErrorCode.SHUTTING_DOWN, f"{op}: the control server is shutting down")

    def _renew(self) -> None:
        self._refuse_if_shutting_down("renew")
        self.last_renewal = self._clock()

    def claim(self, cred_id: int | None) -> None:
        """The ownership claim: current credential only; renews (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8)."""
        self.check(cred_id, "claim")
        self._refuse_if_shutting_down("claim")
        self._renew()

    def bootstrap(self, cred_id: int | None) -> bool:
        """A connection authenticated with ``cred_id``: the first one with the launch credential, before
        any rotation and before the shutdown decision, is the bootstrap handshake and renews. True then."""
        if self.bootstrapped or self.shutting_down or cred_id != LAUNCH_CREDENTIAL_ID or self.highest != 0:
            return False
        self.bootstrapped = True
        self._renew()
        return True

    def remaining(self, now: float | None = None) -> float:
        """Seconds until the unowned period expires (<= 0 once it has)."""
        t = self._clock() if now is None else now
        return self.period_s - (t - self.last_renewal)

    def expired(self, now: float | None = None) -> bool:
        """``now - last_renewal >= period`` (AC-EXECUTORS-CONTROL-OWNERSHIP-003.2)."""
        t = self._clock() if now is None else now
        return t - self.last_renewal >= self.period_s

    def decide_unowned_shutdown(self, now: float | None = None) -> bool:
        """Take the unowned-shutdown decision if the period has expired. True only the one time it is taken."""
        if self.shutting_down or not self.expired(now):
            return False
        self.shutting_down = True
        self.shutdown_reason = "unowned"
        return True

    def begin_shutdown(self, reason: str) -> bool:
        """Latch shutting down for another reason (``ownership_shutdown``, a signal). True if this set it."""
        if self.shutting_down:
            return False
        self.shutting_down = True
        self.shutdown_reason = reason
        return True
