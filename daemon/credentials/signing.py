"""The broker's signing key and the two signed strings it hands out: lease tokens and reissue
capabilities.

The key is 32 random bytes kept in the store's ``installation`` table (row
``credential_signing_key``), created once per Kandev home and never logged, so every lease and
capability stays verifiable across a backend restart (design.md §7; LEASE-CTX-5/6: a stable key,
which is what a survived agent needs to keep git access).

A **lease token** is ``kgl_<secret>.<claims>.<mac>``: 32 random bytes, the lease's non-secret
claims (lease id, session id, host, repository, where the scope came from, issue time, expiry) as
JSON, and an HMAC-SHA256 over both; every part is unpadded base64url. The agent treats it as
opaque. The store keeps only its SHA-256 (``credential_leases.token_hash``); the claims carry the
scope, the MAC makes them unforgeable, and the row (found by the hash) is what expiry and
revocation act on.

A **reissue capability** is ``kgc_<claims>.<mac>``: the exact scope, the session and task, the
lease it came with, an issue time, an expiry and a random id, signed the same way under another
label. It is a bearer secret like the token (lease file only, never logged), authenticated, not
encrypted: its claims are not secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from daemon.store.models import Installation

from .errors import CapabilityInvalid, LeaseInvalid

SIGNING_KEY_NAME = "credential_signing_key"
KEY_BYTES = 32
LEASE_PREFIX = "kgl_"
CAPABILITY_PREFIX = "kgc_"
MAX_TOKEN_CHARS = 4096
_LEASE_LABEL = b"kandev git lease v1\n"
_CAPABILITY_LABEL = b"kandev git reissue capability v1\n"
_B64 = re.compile(r"^[A-Za-z0-9_-]+$")
_KEY_HEX = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------- the key


def _decode_key(value: str) -> bytes:
    if not _KEY_HEX.fullmatch(value):
        raise RuntimeError(f"installation row {SIGNING_KEY_NAME} is malformed; refusing to use it")
    return bytes.fromhex(value)


def ensure_signing_key(engine: Engine) -> None:
    """Create the key at backend start if it is missing (before any launch needs it).

    Uses its own transactions; a concurrent creator wins and its key is kept. ``secrets`` raises
    when the OS has no randomness, which aborts the start (LEASE-CTX-5).
    """
    with engine.begin() as conn:
        if conn.execute(select(Installation.value).where(Installation.key == SIGNING_KEY_NAME)).first():
            return
    try:
        with engine.begin() as conn:
            conn.execute(insert(Installation).values(
                key=SIGNING_KEY_NAME, value=secrets.token_bytes(KEY_BYTES).hex()))
    except IntegrityError:
        pass


def signing_key(db: Session) -> bytes:
    """The key, created in ``db``'s transaction if the backend start did not create it yet."""
    row = db.get(Installation, SIGNING_KEY_NAME)
    if row is None:
        row = Installation(key=SIGNING_KEY_NAME, value=secrets.token_bytes(KEY_BYTES).hex())
        db.add(row)
        db.flush()
    return _decode_key(row.value)


def existing_signing_key(db: Session) -> bytes | None:
    """The key, or None when none was ever created (then no token can be valid)."""
    row = db.get(Installation, SIGNING_KEY_NAME)
    return None if row is None else _decode_key(row.value)


# ---------------------------------------------------------------- encoding


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    if not _B64.fullmatch(text):
        raise ValueError("not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError("not base64url") from exc


def _mac(key: bytes, label: bytes, signed: str) -> bytes:
    return hmac.new(key, label + signed.encode("ascii"), hashlib.sha256).digest()


def _claims_json(claims: dict[str, Any]) -> bytes:
    return json.dumps(claims, sort_keys=True, separators=(",", ":")).encode("utf-8")


def token_hash(token: str) -> str:
    """What the store keeps of a lease token: its SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LeaseClaims:
    lease_id: str
    session_id: str
    host: str
    repository: str
    source: str  # "origin" (the workspace's origin remote) or "request" (named by the caller)
    issued_at: int  # unix seconds
    expires_at: int

    def to_json(self) -> dict[str, Any]:
        return {"v": 1, "lid": self.lease_id, "sid": self.session_id, "host": self.host,
                "repo": self.repository, "src": self.source, "iat": self.issued_at, "exp": self.expires_at}

    @classmethod
    def from_json(cls, d: Any) -> LeaseClaims:
        if not isinstance(d, dict) or d.get("v") != 1:
            raise ValueError("unknown claims version")
        strs = [d.get(k) for k in ("lid", "sid", "host", "repo", "src")]
        ints = [d.get(k) for k in ("iat", "exp")]
        if not all(isinstance(s, str) and s for s in strs):
            raise ValueError("malformed claims")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
            raise ValueError("malformed claims")
        lid, sid, host, repo, src = strs
        return cls(lid, sid, host, repo, src, ints[0], ints[1])  # type: ignore[arg-type]


@dataclass(frozen=True)
class CapabilityClaims:
    lease_id: str  # the lease it was issued with; revoking that lease kills the capability
    session_id: str
    task_id: str
    host: str
    repository: str
    source: str
    issued_at: int
    expires_at: int
    nonce: str

    def to_json(self) -> dict[str, Any]:
        return {"v": 1, "kind": "reissue", "lid": self.lease_id, "sid": self.session_id, "tid": self.task_id,
                "host": self.host, "repo": self.repository, "src": self.source, "iat": self.issued_at,
                "exp": self.expires_at, "jti": self.nonce}

    @classmethod
    def from_json(cls, d: Any) -> CapabilityClaims:
        if not isinstance(d, dict) or d.get("v") != 1 or d.get("kind") != "reissue":
            raise ValueError("unknown capability version")
        strs = [d.get(k) for k in ("lid", "sid", "tid", "host", "repo", "src", "jti")]
        ints = [d.get(k) for k in ("iat", "exp")]
        if not all(isinstance(s, str) and s for s in strs):
            raise ValueError("malformed capability")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ints):
            raise ValueError("malformed capability")
        lid, sid, tid, host, repo, src, jti = strs
        return cls(lid, sid, tid, host, repo, src, ints[0], ints[1], jti)  # type: ignore[arg-type]


def encode_lease(key: bytes, claims: LeaseClaims) -> str:
    signed = f"{LEASE_PREFIX}{_b64(secrets.token_bytes(32))}.{_b64(_claims_json(claims.to_json()))}"
    return f"{signed}.{_b64(_mac(key, _LEASE_LABEL, signed))}"


def _split_lease(token: str) -> tuple[str, str, str]:
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or not token.startswith(LEASE_PREFIX):
        raise LeaseInvalid("not a kandev git lease token")
    parts = token[len(LEASE_PREFIX):].split(".")
    if len(parts) != 3 or not all(parts):
        raise LeaseInvalid("malformed lease token")
    return parts[0], parts[1], parts[2]


def lease_claims_unverified(token: str) -> LeaseClaims:
    """The claims of a token we just issued (for the non-secret snapshot); no MAC check."""
    _, claims, _ = _split_lease(token)
    try:
        return LeaseClaims.from_json(json.loads(_unb64(claims)))
    except ValueError as exc:
        raise LeaseInvalid("malformed lease token") from exc


def decode_lease(key: bytes, token: str) -> LeaseClaims:
    """Verify the MAC (constant time) and return the claims; ``LeaseInvalid`` otherwise."""
    secret, claims, mac = _split_lease(token)
    signed = f"{LEASE_PREFIX}{secret}.{claims}"
    try:
        given = _unb64(mac)
    except ValueError:
        raise LeaseInvalid("malformed lease token") from None
    if not hmac.compare_digest(given, _mac(key, _LEASE_LABEL, signed)):
        raise LeaseInvalid("lease token signature does not verify")
    return lease_claims_unverified(token)


def encode_capability(key: bytes, claims: CapabilityClaims) -> str:
    signed = f"{CAPABILITY_PREFIX}{_b64(_claims_json(claims.to_json()))}"
    return f"{signed}.{_b64(_mac(key, _CAPABILITY_LABEL, signed))}"


def decode_capability(key: bytes, capability: str) -> CapabilityClaims:
    if (not isinstance(capability, str) or len(capability) > MAX_TOKEN_CHARS
            or not capability.startswith(CAPABILITY_PREFIX)):
        raise CapabilityInvalid("not a kandev reissue capability")
    parts = capability[len(CAPABILITY_PREFIX):].split(".")
    if len(parts) != 2 or not all(parts):
        raise CapabilityInvalid("malformed reissue capability")
    signed = f"{CAPABILITY_PREFIX}{parts[0]}"
    try:
        given = _unb64(parts[1])
    except ValueError:
        raise CapabilityInvalid("malformed reissue capability") from None
    if not hmac.compare_digest(given, _mac(key, _CAPABILITY_LABEL, signed)):
        raise CapabilityInvalid("reissue capability signature does not verify")
    try:
        return CapabilityClaims.from_json(json.loads(_unb64(parts[0])))
    except ValueError as exc:
        raise CapabilityInvalid("malformed reissue capability") from exc


def new_nonce() -> str:
    return secrets.token_hex(8)
