"""Git credential leases for agents (Issue 5; RESUME-5, RESUME-6, RESUME-9,
LEASE-CTX-1, LEASE-CTX-2, LEASE-CTX-3, LEASE-CTX-4, LEASE-CTX-5, LEASE-CTX-6, LEASE-CTX-7).

The broker (``broker``) issues a scoped lease to a live session (a per-session credential, never
the upstream token), keeps only the lease token's SHA-256 in ``credential_leases``, and redeems it:
in the backend, for the session's git endpoint (``daemon.backend.git.endpoint``), which alone uses the
upstream token (Issue 20); over the sockets (``credential_redeem``), as a check that answers no
credential. ``signing`` holds the stable signing key (store ``installation`` table) and the token
formats; ``scope`` decides what a lease may open; ``agent_env`` builds the lease file and the
agent environment that routes git through the session's git endpoint.

The resume flow, with the session already persisted STARTING under its resume lock::

    creds = prepare_git_credentials(db, session_id, paths=paths, config=config.credentials)
    record_credential_snapshot(db, session_id, creds.snapshot)   # still STARTING, before launch
    ...launch with env.update(creds.env)...

or the lower-level ``issue_lease`` / ``credential_snapshot`` / ``reissue_capability`` /
``write_lease_file`` / ``agent_git_env``.
"""

from __future__ import annotations

from .agent_env import (
    LEASE_FILE_ENV,
    SOCKET_ENV,
    agent_git_env,
    lease_file_path,
    read_lease_file,
    rewritten_hosts,
    transport_command,
    write_lease_file,
)
from .broker import (
    POLICY_GITHUB_LEASE,
    POLICY_NONE,
    SNAPSHOT_KEY,
    TERMINAL_STATES,
    UPSTREAM_USERNAME,
    GitCredentials,
    Redemption,
    credential_snapshot,
    issue_lease,
    no_credential_snapshot,
    prepare_git_credentials,
    record_credential_snapshot,
    redeem_lease,
    reissue_capability,
    reissue_lease,
    revoke_lease,
    revoke_session_leases,
    upstream_token,
)
from .errors import (
    REISSUABLE_CODES,
    CapabilityInvalid,
    CredentialError,
    CredentialsUnavailable,
    LeaseExpired,
    LeaseInvalid,
    LeaseRevoked,
    NotGitHubBacked,
    ScopeDenied,
    SessionNotFound,
    SessionNotStarting,
    SessionTerminal,
)
from .scope import GITHUB_HOST, LeaseScope, github_scope_for_workspace, parse_remote_url
from .signing import ensure_signing_key, token_hash

__all__ = [
    "GITHUB_HOST",
    "LEASE_FILE_ENV",
    "POLICY_GITHUB_LEASE",
    "POLICY_NONE",
    "REISSUABLE_CODES",
    "SNAPSHOT_KEY",
    "SOCKET_ENV",
    "TERMINAL_STATES",
    "UPSTREAM_USERNAME",
    "CapabilityInvalid",
    "CredentialError",
    "CredentialsUnavailable",
    "GitCredentials",
    "LeaseExpired",
    "LeaseInvalid",
    "LeaseRevoked",
    "LeaseScope",
    "NotGitHubBacked",
    "Redemption",
    "ScopeDenied",
    "SessionNotFound",
    "SessionNotStarting",
    "SessionTerminal",
    "agent_git_env",
    "credential_snapshot",
    "ensure_signing_key",
    "github_scope_for_workspace",
    "issue_lease",
    "lease_file_path",
    "no_credential_snapshot",
    "parse_remote_url",
    "prepare_git_credentials",
    "read_lease_file",
    "record_credential_snapshot",
    "redeem_lease",
    "reissue_capability",
    "reissue_lease",
    "revoke_lease",
    "revoke_session_leases",
    "rewritten_hosts",
    "token_hash",
    "transport_command",
    "upstream_token",
    "write_lease_file",
]
