"""The ownership handshake on one connection to ``kandev-agentctl``, and the unauthenticated probe.

``handshake`` runs, on a fresh connection and before anything else is sent, ``identify`` (the
identity and capability set must be readable and, when one is recorded, the expected identity),
``prove`` (the server's proof is checked in constant time before anything else is sent) and
``authenticate`` (``auth_begin``/``auth_finish``: an HMAC over the server's nonce; the credential
never crosses the socket). A refusal is ``OwnershipRefused`` with the reason of
docs/requirements.md#control-server-ownership. ``identify`` is the standalone probe: None when
nothing answers. ``reload_seen_recently`` remembers that a server said it is re-executing, so a slow
answer within ``RELOAD_WINDOW_S`` is taken for that re-exec (``daemon.agentctl.client.connection`` reconnects
patiently; the backend's adoption read budget waits).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

from daemon.agentctl import auth
from daemon.agentctl.client.replies import ServerIdentity
from daemon.agentctl.protocol import VERSION
from ipc.client import AsyncClient
from ipc.errors import ErrorCode, IpcError

IDENTITY_MISMATCH = "identity_mismatch"
AUTHENTICATION_FAILURE = "authentication_failure"
RELOAD_WINDOW_S = 90.0
"""How long a call keeps connecting and sending again while the server re-executes."""


class OwnershipRefused(Exception):
    """The server is not one this backend may drive. ``reason``: ``identity_mismatch`` or
    ``authentication_failure`` (the refusal reasons of docs/requirements.md#control-server-ownership)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


async def identify(socket_path: str | os.PathLike[str], timeout: float = 2.0) -> ServerIdentity | None:
    """The server's unauthenticated identity, or None if nothing answers.

    Raises ``IpcError`` when something answers with an error (it is then not a
    control server this backend can identify).
    """
    try:
        conn = await AsyncClient.connect(socket_path, timeout=timeout, hello=False)
    except IpcError as exc:
        if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
            return None
        raise
    try:
        result = await conn.call("identify", timeout=timeout)
    except IpcError as exc:
        if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
            return None
        if exc.code == ErrorCode.RELOADING:  # alive, re-executing: the caller asks again
            saw_reload()
        raise
    finally:
        await conn.close()
    return cast(ServerIdentity, result) if isinstance(result, dict) else None  # the wire, as the server sends it


async def handshake(
    conn: AsyncClient,
    *,
    credential: bytes,
    installation_id: str,
    expected_identity: str | None,
    timeout: float,
) -> dict[str, Any]:
    """identify -> prove (verified) -> auth_begin/auth_finish on ``conn``; returns the identify result."""
    try:
        info = await conn.call("identify", timeout=timeout)
    except IpcError as exc:
        if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INCOMPATIBLE_VERSION, ErrorCode.RELOADING):
            if exc.code == ErrorCode.RELOADING:
                saw_reload()
            raise
        # Something answers, but not with an identity: unreadable counts as a mismatch.
        raise OwnershipRefused(IDENTITY_MISMATCH, f"identify was refused: {exc.message}") from None
    identity = info.get("server_identity") if isinstance(info, dict) else None
    capabilities = info.get("capabilities") if isinstance(info, dict) else None
    if not isinstance(identity, str) or not identity:
        raise OwnershipRefused(IDENTITY_MISMATCH, "the server reported no identity")
    if not isinstance(capabilities, list) or not all(isinstance(c, str) for c in capabilities):
        raise OwnershipRefused(IDENTITY_MISMATCH, "the server reported no capability set")
    if expected_identity is not None and identity != expected_identity:
        raise OwnershipRefused(IDENTITY_MISMATCH, "the server's identity is not the recorded one")
    version = info.get("protocol_version")
    if not isinstance(version, list) or not version or version[0] != VERSION[0]:
        raise IpcError(
            ErrorCode.INCOMPATIBLE_VERSION,
            f"the control server speaks protocol {version!r:.40}; this client speaks major {VERSION[0]}",
        )

    challenge = auth.new_challenge()
    answer = await conn.call("prove", {"challenge": challenge}, timeout=timeout)
    proofs = answer.get("proofs") if isinstance(answer, dict) else None
    expected = auth.server_proof(credential, challenge, identity, installation_id)
    proven = False
    if isinstance(proofs, list):
        for proof in proofs[:2]:  # at most two acceptable credentials
            proven |= auth.verify(expected, proof)
    if not proven:
        raise OwnershipRefused(AUTHENTICATION_FAILURE, "the server did not prove it holds the credential")

    info = dict(info)
    info["credential_role"] = await authenticate(conn, credential=credential, identity=identity, timeout=timeout)
    return info


async def authenticate(conn: AsyncClient, *, credential: bytes, identity: str, timeout: float) -> str | None:
    """auth_begin/auth_finish with ``credential``; returns the slot the server says it filled
    (``current`` / ``superseded``; None from a server that does not say)."""
    begun = await conn.call("auth_begin", timeout=timeout)
    nonce = begun.get("nonce") if isinstance(begun, dict) else None
    if not isinstance(nonce, bytes) or len(nonce) != auth.CHALLENGE_BYTES:
        raise OwnershipRefused(AUTHENTICATION_FAILURE, "the server sent a malformed nonce")
    try:
        finished = await conn.call(
            "auth_finish",
            {"proof": auth.connection_proof(credential, nonce, identity)},
            timeout=timeout,
        )
    except IpcError as exc:
        if exc.code == ErrorCode.UNAUTHENTICATED:
            raise OwnershipRefused(AUTHENTICATION_FAILURE, exc.message) from None
        raise
    role = finished.get("credential") if isinstance(finished, dict) else None
    return role if isinstance(role, str) else None


_last_reload_seen: float | None = None  # loop time a server last answered "reloading"


def reload_seen_recently() -> bool:
    """Whether a control server said it is re-executing within ``RELOAD_WINDOW_S``: a slow
    answer is then most likely that re-exec, not a dead server (the backend's read budget uses it)."""
    if _last_reload_seen is None:
        return False
    return asyncio.get_running_loop().time() - _last_reload_seen < RELOAD_WINDOW_S


def saw_reload() -> None:
    global _last_reload_seen
    _last_reload_seen = asyncio.get_running_loop().time()
