"""Ownership proofs: pure HMAC-SHA256 functions used by both sides.

The control server and the backend import this module, so the two sides
cannot compute a proof differently (docs/architecture.md#ownership, AC-EXECUTORS-CONTROL-
AC-EXECUTORS-CONTROL-OWNERSHIP-001.10). The credential never crosses the socket:

- ``server_proof``: the backend sends a fresh 32-byte challenge; the server
  answers ``HMAC(cred, "kandev-prove\\0" || challenge || identity || "\\0" ||
  installation_id)`` for each credential it accepts. The backend recomputes it
  and compares in constant time before it sends or stores anything.
- ``connection_proof``: to authenticate a connection, the server hands out a
  fresh nonce and the backend answers ``HMAC(cred, "kandev-auth\\0" || nonce ||
  identity)``.

Distinct labels keep one kind of proof from ever being replayed as the other.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

CREDENTIAL_BYTES = 32
"""Length of an ownership credential (random bytes)."""

CHALLENGE_BYTES = 32
"""Length of a backend challenge and of a server nonce."""

PROVE_LABEL = b"kandev-prove\0"
AUTH_LABEL = b"kandev-auth\0"


def new_credential() -> bytes:
    """A fresh random credential."""
    return secrets.token_bytes(CREDENTIAL_BYTES)


def new_challenge() -> bytes:
    """A fresh random challenge or nonce."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def _check_key(credential: bytes) -> None:
    if not isinstance(credential, bytes | bytearray) or not credential:
        raise ValueError("a credential must be non-empty bytes")


def server_proof(credential: bytes, challenge: bytes, server_identity: str, installation_id: str) -> bytes:
    """What the server answers to ``prove``: it holds ``credential`` (32-byte MAC)."""
    _check_key(credential)
    message = (
        PROVE_LABEL
        + bytes(challenge)
        + server_identity.encode("utf-8")
        + b"\0"
        + installation_id.encode("utf-8")
    )
    return hmac.new(bytes(credential), message, hashlib.sha256).digest()


def connection_proof(credential: bytes, nonce: bytes, server_identity: str) -> bytes:
    """What the backend answers to ``auth_begin``'s nonce (32-byte MAC)."""
    _check_key(credential)
    message = AUTH_LABEL + bytes(nonce) + server_identity.encode("utf-8")
    return hmac.new(bytes(credential), message, hashlib.sha256).digest()


def verify(expected: bytes, got: object) -> bool:
    """Constant-time comparison; anything that is not bytes is simply wrong."""
    if not isinstance(got, bytes | bytearray):
        return False
    return hmac.compare_digest(bytes(expected), bytes(got))
