"""The git credential broker: scoped leases on the upstream GitHub token (Issue 5; LEASE-CTX-2).

Every function takes the caller's SQLAlchemy session ``db`` and works inside its transaction;
the caller commits. Nothing here ever logs, returns in an error or stores a lease token, a
capability or the upstream token: the store keeps the token's SHA-256 only, the journal gets lease
ids, session ids, hosts and repositories.

Rules:

- RESUME-9 / LEASE-CTX-7: a COMPLETED, FAILED or CANCELLED session gets no lease and redeems
  none (``SessionTerminal``). The resume flow therefore persists STARTING first, then calls
  ``issue_lease`` (or ``prepare_git_credentials``).
- LEASE-CTX-4: the session's live state and scope are re-checked at issue, at redemption and at
  reissue: the session must not be terminal, and a scope taken from the workspace's ``origin``
  must still be what that origin names (a changed repository identity is refused).
- Expired, revoked, unknown or forged leases are refused; so is a protocol other than https or
  a host or repository outside the lease's scope.
- LEASE-CTX-5, LEASE-CTX-6: the signing key is stable (kept in the store), so leases and capabilities
  issued before a backend restart (e.g. to an agent that survived it) keep working after it.
- LEASE-CTX-3: the helper may reissue once after a lease failure with its capability; revoking
  the lease a capability came with (``revoke_session_leases``) ends that too.

The upstream token is read from ``credentials.github_token_file`` (0600, ours, not a symlink) at
issue (to fail before launch, not at the agent's first ``git fetch``) and at each redemption (so
a rotated file takes effect without a restart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select, update
from sqlalchemy.orm import Session

from daemon.config.settings import CredentialsConfig
from daemon.core.journal import log_event
from daemon.host.paths import Paths, SecretFileError, read_secret_file
from daemon.host.session_dirs import SessionDirs
from daemon.store.models import CredentialLease, Task, TaskSession, new_id
from daemon.store.states import SessionState

from .agent_env import agent_git_env, lease_file_path, rewritten_hosts, write_lease_file, write_no_lease_file
from .errors import (
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
from .scope import LeaseScope, github_scope, github_scope_for_workspace, normalize_repository
from .signing import (
    CapabilityClaims,
    LeaseClaims,
    decode_capability,
    decode_lease,
    encode_capability,
    encode_lease,
    existing_signing_key,
    lease_claims_unverified,
    new_nonce,
    signing_key,
    token_hash,
)

TERMINAL_STATES = frozenset({SessionState.COMPLETED, SessionState.FAILED, SessionState.CANCELLED})
POLICY_GITHUB_LEASE = "github-lease"
POLICY_NONE = "none"
SNAPSHOT_KEY = "git_credential_snapshot"
UPSTREAM_USERNAME = "x-access-token"
CAPABILITY_TTL_S = 24 * 3600
# Rows expired for longer than a capability can live are useless (nothing can reissue from
# them): deleted whenever a lease is issued.
PURGE_AFTER_S = CAPABILITY_TTL_S
MAX_UPSTREAM_TOKEN_BYTES = 4096


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


def _iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _refused(action: str, exc: CredentialError, **fields: str | None) -> None:
    log_event(
        "credential_refused",
        f"git credential {action} refused: {exc.code}: {exc.message}",
        priority=4,
        ACTION=action,
        REASON=exc.code,
        **fields,
    )


# ---------------------------------------------------------------- live state


def _live_session(db: Session, session_id: str) -> tuple[TaskSession, Task]:
    session = db.get(TaskSession, session_id)
    if session is None:
        raise SessionNotFound(f"no session with id {session_id!r:.80}")
    if session.state in TERMINAL_STATES:
        raise SessionTerminal(
            f"session {session_id} is {session.state}: COMPLETED, FAILED and CANCELLED sessions get no git"
            " credential lease (RESUME-9); a resume persists STARTING before asking for one"
        )
    task = db.get(Task, session.task_id)
    if task is None:
        raise SessionNotFound(f"session {session_id} has no task")
    return session, task


def _hosts(config: CredentialsConfig) -> tuple[str, ...]:
    """The hosts a lease may be for: github.com and the host of ``credentials.github_url``."""
    return tuple(rewritten_hosts(config.github_url))


def _resolve_scope(task: Task, requested: LeaseScope | None, hosts: tuple[str, ...]) -> tuple[LeaseScope, str]:
    """The scope to issue and where it came from: ``recorded`` (the task's ``git_remote``, recorded
    when it was created, before any agent ran: Issue 20), ``origin`` (a task created before that was
    recorded: the workspace's origin, re-checked at every use) or ``request``."""
    if task.git_remote:
        live, source = github_scope(task.git_remote, hosts), "recorded"
    else:
        live, source = github_scope_for_workspace(task.workspace, hosts), "origin"
    if requested is None:
        if live is None:
            raise NotGitHubBacked(
                f"task {task.id}'s repository is not on {' or '.join(hosts)};"
                " name the host and repository to ask for a lease anyway"
            )
        return live, source
    if requested.host not in hosts:
        raise ScopeDenied(f"leases are issued for {' or '.join(hosts)} only, not {requested.host}")
    if live is not None:
        if live != requested:
            raise ScopeDenied(
                f"the task's repository is {live}; a lease for {requested} is not issued to this session"
            )
        return live, source
    return requested, "request"


def _check_live_scope(task: Task, host: str, repository: str, source: str, hosts: tuple[str, ...]) -> None:
    if source != "origin":
        return
    live = github_scope_for_workspace(task.workspace, hosts)
    if live is None or live != LeaseScope(host, repository):
        now = str(live) if live is not None else "no GitHub origin"
        raise ScopeDenied(f"the workspace's repository changed since the lease was issued (now {now})")


def upstream_token(config: CredentialsConfig) -> str:
    """The upstream GitHub token from ``credentials.github_token_file``; never logged."""
    if not config.github_token_file:
        raise CredentialsUnavailable("credentials.github_token_file is not set: no upstream GitHub token")
    path = Path(config.github_token_file)
    try:
        data = read_secret_file(path)
    except SecretFileError as exc:
        raise CredentialsUnavailable(
            f"credentials.github_token_file {path}: {exc.reason} ({str(exc).split(': ', 1)[-1]})"
        ) from None
    except OSError as exc:
        raise CredentialsUnavailable(f"credentials.github_token_file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_UPSTREAM_TOKEN_BYTES:
        raise CredentialsUnavailable(f"credentials.github_token_file {path} is too large to hold a token")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CredentialsUnavailable(f"credentials.github_token_file {path} does not hold an ASCII token") from None
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise CredentialsUnavailable(
            f"credentials.github_token_file {path} must hold exactly one token (no spaces or lines)"
        )
    return token


# ---------------------------------------------------------------- issue


def _issue(db: Session, session: TaskSession, task: Task, scope: LeaseScope, source: str,
           config: CredentialsConfig, now: datetime) -> tuple[str, str]:
    upstream_token(config)  # fail now, before launch, when there is nothing to redeem
    key = signing_key(db)
    iat = int(now.timestamp())
    exp = iat + max(1, math.ceil(config.lease_ttl))
    lease_id = new_id()
    token = encode_lease(key, LeaseClaims(lease_id, session.id, scope.host, scope.repository, source, iat, exp))
    db.execute(delete(CredentialLease).where(
        CredentialLease.expires_at < now - timedelta(seconds=PURGE_AFTER_S)))
    db.add(CredentialLease(id=lease_id, session_id=session.id, token_hash=token_hash(token),
                           expires_at=datetime.fromtimestamp(exp, UTC), revoked=False))
    db.flush()
    log_event(
        "credential_lease_issued",
        f"git credential lease {lease_id} issued to session {session.id} for {scope} until {_iso(exp)}",
        LEASE_ID=lease_id,
        SESSION_ID=session.id,
        TASK_ID=task.id,
        HOST=scope.host,
        REPOSITORY=scope.repository,
        SCOPE_SOURCE=source,
        EXPIRES_AT=_iso(exp),
    )
    return token, lease_id


def issue_lease(
    db: Session,
    session_id: str,
    scope: LeaseScope | None = None,
    *,
    config: CredentialsConfig,
    now: datetime | None = None,
) -> tuple[str, str]:
    """Issue a lease to a non-terminal session: ``(lease_token, lease_id)``.

    ``scope`` None: the workspace's github.com origin (``NotGitHubBacked`` without one). A given
    scope must be on github.com and, when the workspace has a github.com origin, be that
    repository. Raises a ``CredentialError`` (``SessionTerminal`` for COMPLETED, FAILED and
    CANCELLED: RESUME-9). The token is a secret: hand it to the agent through a lease file only.
    """
    try:
        session, task = _live_session(db, session_id)
        resolved, source = _resolve_scope(task, scope, _hosts(config))
        return _issue(db, session, task, resolved, source, config, _now(now))
    except CredentialError as exc:
        _refused("issue", exc, SESSION_ID=session_id)
        raise


def credential_snapshot(lease_token: str) -> dict[str, Any]:
    """The non-secret ``git_credential_snapshot`` of a lease (RESUME-6): policy, host, repository,
    where the scope came from, lease id, issue and expiry times. Never contains the token."""
    c = lease_claims_unverified(lease_token)
    return {
        "policy": POLICY_GITHUB_LEASE,
        "host": c.host,
        "repository": c.repository,
        "scope_source": c.source,
        "lease_id": c.lease_id,
        "issued_at": _iso(c.issued_at),
        "expires_at": _iso(c.expires_at),
    }


def no_credential_snapshot(reason: str) -> dict[str, Any]:
    """The snapshot of an attempt that got no lease (policy ``none``)."""
    return {"policy": POLICY_NONE, "reason": reason}


def record_credential_snapshot(db: Session, session_id: str, snapshot: dict[str, Any]) -> None:
    """Store ``snapshot`` as ``task_sessions.metadata_json["git_credential_snapshot"]``, only while
    the session is STARTING (RESUME-6), as a compare-and-set on that state. Replaces any earlier
    snapshot (so an earlier attempt's policy does not linger). ``SessionNotStarting`` (code
    ``conflict``) when the session is not STARTING."""
    session = db.get(TaskSession, session_id)
    if session is None:
        raise SessionNotFound(f"no session with id {session_id!r:.80}")
    meta = dict(session.metadata_json or {})
    meta[SNAPSHOT_KEY] = dict(snapshot)
    result = cast("CursorResult[Any]", db.execute(
        update(TaskSession)
        .where(TaskSession.id == session_id, TaskSession.state == SessionState.STARTING)
        .values(metadata_json=meta)
        .execution_options(synchronize_session="fetch")
    ))
    if result.rowcount != 1:
        db.refresh(session)
        raise SessionNotStarting(f"session {session_id} is {session.state}, not STARTING: snapshot not stored")


def reissue_capability(db: Session, lease_token: str, *, now: datetime | None = None) -> str:
    """A capability that lets the helper get a new lease for the same scope (LEASE-CTX-2, LEASE-CTX-3) while
    the session is live, for ``CAPABILITY_TTL_S``. A secret, like the token: lease file only."""
    key = signing_key(db)
    c = decode_lease(key, lease_token)
    session = db.get(TaskSession, c.session_id)
    if session is None:
        raise SessionNotFound(f"no session with id {c.session_id!r:.80}")
    iat = int(_now(now).timestamp())
    return encode_capability(key, CapabilityClaims(
        c.lease_id, c.session_id, session.task_id, c.host, c.repository, c.source, iat, iat + CAPABILITY_TTL_S,
        new_nonce()))


# ---------------------------------------------------------------- redeem


@dataclass(frozen=True)
class Redemption:
    lease_id: str
    session_id: str
    host: str
    repository: str
    expires_at: str
    username: str
    password: str  # the upstream token: to the helper only, never logged

    def __repr__(self) -> str:  # keep the secret out of tracebacks and debug output
        return f"Redemption(lease_id={self.lease_id!r}, session_id={self.session_id!r}, password=<hidden>)"


def redeem_lease(
    db: Session,
    lease_token: str,
    host: str,
    path: str,
    *,
    config: CredentialsConfig,
    protocol: str = "https",
    now: datetime | None = None,
) -> Redemption:
    """Check a lease against the request and the live state; return the upstream credential."""
    lease_id: str | None = None
    session_id: str | None = None
    try:
        key = existing_signing_key(db)
        if key is None:
            raise LeaseInvalid("no lease was ever issued by this installation")
        claims = decode_lease(key, lease_token)
        row = db.scalar(select(CredentialLease).where(CredentialLease.token_hash == token_hash(lease_token)))
        if row is None or row.id != claims.lease_id or row.session_id != claims.session_id:
            raise LeaseInvalid("unknown lease")
        lease_id, session_id = row.id, row.session_id
        if row.revoked:
            raise LeaseRevoked(f"lease {row.id} was revoked")
        current = _now(now)
        if current >= row.expires_at:
            raise LeaseExpired(f"lease {row.id} expired at {_iso(int(row.expires_at.timestamp()))}")
        if protocol.lower() != "https":
            raise ScopeDenied(f"lease {row.id} is for https only, not {protocol!r:.20}")
        if host.strip().lower() != claims.host:
            raise ScopeDenied(f"lease {row.id} is for {claims.host}, not {host!r:.100}")
        repo = normalize_repository(path, allow_lfs_suffix=True)
        if repo is None:
            raise ScopeDenied(
                f"lease {row.id}: path {path!r:.200} does not name one repository"
                " (git must send the path: credential.useHttpPath)"
            )
        if repo != claims.repository:
            raise ScopeDenied(f"lease {row.id} is for {claims.host}/{claims.repository}, not {repo}")
        _session, task = _live_session(db, row.session_id)
        _check_live_scope(task, claims.host, claims.repository, claims.source, _hosts(config))
        password = upstream_token(config)
    except CredentialError as exc:
        _refused("redeem", exc, LEASE_ID=lease_id, SESSION_ID=session_id)
        raise
    log_event(
        "credential_redeemed",
        f"git credential lease {lease_id} redeemed by session {session_id} for {claims.host}/{repo}",
        LEASE_ID=lease_id,
        SESSION_ID=session_id,
        HOST=claims.host,
        REPOSITORY=repo,
    )
    return Redemption(lease_id, row.session_id, claims.host, repo, _iso(claims.expires_at), UPSTREAM_USERNAME,
                      password)


def reissue_lease(
    db: Session, capability: str, *, config: CredentialsConfig, now: datetime | None = None
) -> tuple[str, str]:
    """A new lease for a capability's exact scope, re-checked against the live state
    (LEASE-CTX-4): ``(lease_token, lease_id)``."""
    session_id: str | None = None
    try:
        key = existing_signing_key(db)
        if key is None:
            raise CapabilityInvalid("no capability was ever issued by this installation")
        c = decode_capability(key, capability)
        session_id = c.session_id
        current = _now(now)
        if int(current.timestamp()) >= c.expires_at:
            raise CapabilityInvalid(f"reissue capability of lease {c.lease_id} expired at {_iso(c.expires_at)}")
        origin = db.get(CredentialLease, c.lease_id)
        if origin is None or origin.session_id != c.session_id:
            raise CapabilityInvalid(f"reissue capability names unknown lease {c.lease_id}")
        if origin.revoked:
            raise CapabilityInvalid(f"lease {c.lease_id} was revoked; its capability is void")
        session, task = _live_session(db, c.session_id)
        if task.id != c.task_id:
            raise CapabilityInvalid("reissue capability names another task")
        _check_live_scope(task, c.host, c.repository, c.source, _hosts(config))
        return _issue(db, session, task, LeaseScope(c.host, c.repository), c.source, config, current)
    except CredentialError as exc:
        _refused("reissue", exc, SESSION_ID=session_id)
        raise


# ---------------------------------------------------------------- revoke


def revoke_lease(db: Session, lease_id: str) -> bool:
    """Revoke one lease; True if it existed."""
    row = db.get(CredentialLease, lease_id)
    if row is None:
        return False
    row.revoked = True
    log_event("credential_lease_revoked", f"git credential lease {lease_id} revoked", LEASE_ID=lease_id,
              SESSION_ID=row.session_id)
    return True


def revoke_session_leases(db: Session, session_id: str) -> int:
    """Revoke every lease of a session (and so every capability issued with them)."""
    result = cast("CursorResult[Any]", db.execute(
        update(CredentialLease)
        .where(CredentialLease.session_id == session_id, CredentialLease.revoked.is_(False))
        .values(revoked=True)
        .execution_options(synchronize_session="fetch")
    ))
    count = int(result.rowcount or 0)
    if count:
        log_event("credential_lease_revoked", f"{count} git credential lease(s) of session {session_id} revoked",
                  SESSION_ID=session_id, COUNT=count)
    return count


# ---------------------------------------------------------------- one call for a launch


@dataclass(frozen=True)
class GitCredentials:
    """What a launch needs: the policy, its snapshot, the env to add, and the lease's id/file."""

    policy: str
    snapshot: dict[str, Any]
    env: dict[str, str]
    lease_id: str | None = None
    lease_file: Path | None = None


def prepare_git_credentials(
    db: Session,
    session_id: str,
    *,
    paths: Paths,
    config: CredentialsConfig,
    scope: LeaseScope | None = None,
    base_env: dict[str, str] | None = None,
    socket: Path | None = None,
    now: datetime | None = None,
) -> GitCredentials:
    """Issue a lease (with a reissue capability), write the session's lease file and build the
    agent env; or policy ``none`` when the session is not GitHub-backed or no upstream token is
    configured. ``socket``: where the agent's helper redeems it; the backend passes the session's
    own credential endpoint; default the backend socket (whose ops serve any lease). Either way the leases of the session's earlier attempts are revoked first. Call it with the session already STARTING (RESUME-5, RESUME-9); then store
    ``result.snapshot`` with ``record_credential_snapshot`` before launch (RESUME-6).

    ``SessionTerminal`` and the other ``CredentialError``s propagate (e.g. a configured but
    unreadable token file): the caller restores the prior state (RESUME-7).
    """
    try:
        _live_session(db, session_id)  # RESUME-9 holds whatever the policy turns out to be
    except CredentialError as exc:
        _refused("issue", exc, SESSION_ID=session_id)
        raise
    # A launch replaces the session's agent: the leases (and capabilities) of earlier attempts end.
    revoke_session_leases(db, session_id)
    if not config.github_token_file:
        reason = "credentials.github_token_file is not set"
        _session, task = _live_session(db, session_id)
        try:
            _resolve_scope(task, scope, _hosts(config))
        except CredentialError:
            return GitCredentials(POLICY_NONE, no_credential_snapshot(reason), {})
        # GitHub-backed without a token: git is still routed to kandev's transport, which fails a
        # fetch or push saying which setting to fix (Issue 20 item 4) instead of asking GitHub anonymously.
        SessionDirs.for_session(paths.home, session_id).ensure()
        no_lease = write_no_lease_file(
            lease_file_path(paths, session_id),
            f"{reason}: kandev holds no GitHub token for this session; set it and resume the session")
        env = agent_git_env(no_lease, socket or paths.backend_socket, base_env=base_env, github_url=config.github_url)
        return GitCredentials(POLICY_NONE, no_credential_snapshot(reason), env)
    try:
        token, lease_id = issue_lease(db, session_id, scope, config=config, now=now)
    except NotGitHubBacked as exc:
        return GitCredentials(POLICY_NONE, no_credential_snapshot(exc.message), {})
    capability = reissue_capability(db, token, now=now)
    SessionDirs.for_session(paths.home, session_id).ensure()
    lease_file = write_lease_file(lease_file_path(paths, session_id), token, capability)
    env = agent_git_env(lease_file, socket or paths.backend_socket, base_env=base_env, github_url=config.github_url)
    return GitCredentials(POLICY_GITHUB_LEASE, credential_snapshot(token), env, lease_id, lease_file)
