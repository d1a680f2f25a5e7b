"""Typed refusals of the credential broker.

Each carries a stable ``code`` (sent on the backend socket as the error code) and a message that
never contains a lease token, a capability or the upstream token. ``reissuable`` marks the three
lease failures after which the git credential helper may try its one reissue (LEASE-CTX-3).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError


class CredentialError(Exception):
    code = "credential_error"
    reissuable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_ipc(self) -> IpcError:
        return IpcError(self.code, self.message, retryable=False)


class SessionNotFound(CredentialError):
    code = ErrorCode.NOT_FOUND


class SessionTerminal(CredentialError):
    """RESUME-9: COMPLETED, FAILED and CANCELLED sessions get no lease and redeem none."""

    code = "session_terminal"


class NotGitHubBacked(CredentialError):
    """The session's workspace has no github.com ``origin`` and the request named no scope."""

    code = "not_github_backed"


class ScopeDenied(CredentialError):
    """A host or repository outside the lease's scope, or a scope the live state no longer backs."""

    code = "scope_denied"


class CredentialsUnavailable(CredentialError):
    """No upstream token: ``credentials.github_token_file`` unset, missing or unsafe."""

    code = "credentials_unavailable"


class LeaseInvalid(CredentialError):
    """Malformed, forged or unknown lease token."""

    code = "lease_invalid"
    reissuable = True


class LeaseExpired(CredentialError):
    code = "lease_expired"
    reissuable = True


class LeaseRevoked(CredentialError):
    code = "lease_revoked"
    reissuable = True


class SessionNotStarting(CredentialError):
    """The snapshot is stored only while the session is STARTING (RESUME-6)."""

    code = ErrorCode.CONFLICT


class CapabilityInvalid(CredentialError):
    """A reissue capability that is malformed, forged, expired or whose lease was revoked."""

    code = "capability_invalid"


REISSUABLE_CODES = frozenset(c.code for c in (LeaseInvalid, LeaseExpired, LeaseRevoked))


def off_loop_handler(
    work: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[ConnectionContext, dict[str, Any]], Awaitable[dict[str, Any]]]:
    """An op handler running ``work`` (blocking: the store, signing) off the event loop, a refusal
    answered as its typed error."""

    async def handler(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return await asyncio.to_thread(work, args)
        except CredentialError as exc:
            raise exc.to_ipc() from None

    return handler
