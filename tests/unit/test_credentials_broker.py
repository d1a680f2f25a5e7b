"""daemon.credentials.broker: hash-only storage, expiry, revocation, terminal sessions, scope, the
stable signing key, reissue capabilities and the git_credential_snapshot.

Requirement IDs: RESUME-5, RESUME-6, RESUME-9 (the broker refuses COMPLETED, FAILED and
CANCELLED sessions), LEASE-CTX-2, LEASE-CTX-3, LEASE-CTX-4, LEASE-CTX-5, LEASE-CTX-6, LEASE-CTX-7 (context adopted: scoped lease, at most one reissue through an
authenticated capability re-checked against live state, stable signing key across restarts).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from daemon import git_credential_helper as helper
from daemon.config.settings import CredentialsConfig
from daemon.credentials import (
    POLICY_GITHUB_LEASE,
    POLICY_NONE,
    SNAPSHOT_KEY,
    CapabilityInvalid,
    CredentialsUnavailable,
    LeaseExpired,
    LeaseInvalid,
    LeaseRevoked,
    LeaseScope,
    NotGitHubBacked,
    ScopeDenied,
    SessionNotStarting,
    SessionTerminal,
    credential_snapshot,
    ensure_signing_key,
    issue_lease,
    prepare_git_credentials,
    read_lease_file,
    record_credential_snapshot,
    redeem_lease,
    reissue_capability,
    reissue_lease,
    revoke_lease,
    revoke_session_leases,
    token_hash,
)
from daemon.credentials.signing import SIGNING_KEY_NAME, _b64, _unb64
from daemon.host.paths import Paths
from daemon.store.db import Store, sqlite_url
from daemon.store.models import CredentialLease, Installation, TaskSession
from tests.support import store_rows

UPSTREAM = "ghp_UPSTREAMtokenNeverLogged0123456789"
T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_repo(path: Path, origin: str | None = "https://github.com/example/repo.git") -> Path:
    path.mkdir(parents=True)
    git("init", "-q", cwd=path)
    if origin:
        git("remote", "add", "origin", origin, cwd=path)
    return path


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "github-token"
    p.write_text(UPSTREAM + "\n")
    p.chmod(0o600)
    return p


@pytest.fixture
def config(token_file: Path) -> CredentialsConfig:
    return CredentialsConfig(github_token_file=str(token_file), lease_ttl=3600.0)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


def new_session(store: Store, workspace: Path | None, state: str = "STARTING") -> str:
    """A starting session of a task whose workspace is ``workspace``."""
    return store_rows.new_session(store, state, workspace=str(workspace) if workspace else None)


def set_state(store: Store, session_id: str, state: str) -> None:
    with store.session() as db:
        db.get(TaskSession, session_id).state = state


def issue(store: Store, sid: str, config: CredentialsConfig, scope: LeaseScope | None = None,
          now: datetime = T0) -> tuple[str, str]:
    with store.session() as db:
        return issue_lease(db, sid, scope, config=config, now=now)


def redeem(store: Store, token: str, config: CredentialsConfig, host: str = "github.com",
           path: str = "example/repo.git", now: datetime = T0 + timedelta(seconds=5), protocol: str = "https"):
    with store.session() as db:
        return redeem_lease(db, token, host, path, config=config, now=now, protocol=protocol)


def dump(store: Store) -> str:
    raw = store.engine.raw_connection()
    try:
        return "\n".join(raw.driver_connection.iterdump())
    finally:
        raw.close()


# ---------------------------------------------------------------- issue and redeem


def test_lease_token_is_opaque_and_only_its_sha256_is_stored(store: Store, repo: Path,
                                                              config: CredentialsConfig) -> None:
    """LEASE-CTX-1: credential_leases holds hashes only; neither the token, its random part nor
    the upstream token is anywhere in the database."""
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    assert token.startswith("kgl_")
    with store.session() as db:
        row = db.get(CredentialLease, lease_id)
        assert row.token_hash == token_hash(token) and len(row.token_hash) == 64
        assert row.session_id == sid and row.revoked is False
        assert row.expires_at == T0 + timedelta(hours=1)
    everything = dump(store)
    secret_part = token[len("kgl_"):].split(".")[0]
    assert token not in everything and secret_part not in everything and UPSTREAM not in everything


def test_redeem_returns_the_upstream_token_for_the_scoped_repository(store: Store, repo: Path,
                                                                      config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    for path in ("example/repo.git", "example/repo", "/Example/Repo.git/", "example/repo.git/info/lfs"):
        r = redeem(store, token, config, path=path)
        assert (r.username, r.password, r.lease_id, r.session_id) == ("x-access-token", UPSTREAM, lease_id, sid)
        assert (r.host, r.repository) == ("github.com", "example/repo")
        assert UPSTREAM not in repr(r)


def test_lease_expires_after_lease_ttl(store: Store, repo: Path, config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    token, _ = issue(store, sid, config)
    redeem(store, token, config, now=T0 + timedelta(seconds=3599))
    with pytest.raises(LeaseExpired):
        redeem(store, token, config, now=T0 + timedelta(seconds=3600))
    short = CredentialsConfig(github_token_file=config.github_token_file, lease_ttl=60.0)
    token2, _ = issue(store, sid, short)
    with pytest.raises(LeaseExpired):
        redeem(store, token2, short, now=T0 + timedelta(seconds=61))


def test_revoked_lease_is_refused(store: Store, repo: Path, config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    other, _ = issue(store, sid, config)
    with store.session() as db:
        assert revoke_lease(db, lease_id) is True
        assert revoke_lease(db, "nope") is False
    with pytest.raises(LeaseRevoked):
        redeem(store, token, config)
    redeem(store, other, config)
    with store.session() as db:
        assert revoke_session_leases(db, sid) == 1
    with pytest.raises(LeaseRevoked):
        redeem(store, other, config)


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED", "CANCELLED"])
def test_terminal_session_gets_no_lease(store: Store, repo: Path, config: CredentialsConfig, state: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """RESUME-9: the broker refuses COMPLETED, FAILED and CANCELLED sessions with a typed error,
    and still issues once the (resume) flow has persisted STARTING (RESUME-5, LEASE-CTX-7)."""
    sid = new_session(store, repo, state=state)
    with pytest.raises(SessionTerminal) as err:
        issue(store, sid, config)
    assert err.value.code == "session_terminal" and state in err.value.message
    with store.session() as db:
        assert db.scalars(select(CredentialLease)).all() == []
    assert any(getattr(r, "kandev_event", None) == "credential_refused" for r in caplog.records)
    if state != "COMPLETED":  # FAILED/CANCELLED -> STARTING is the resume edge
        set_state(store, sid, "STARTING")
        token, _ = issue(store, sid, config)
        redeem(store, token, config)


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED", "CANCELLED"])
def test_lease_of_a_session_that_became_terminal_no_longer_redeems(store: Store, repo: Path,
                                                                   config: CredentialsConfig, state: str) -> None:
    """RESUME-9, LEASE-CTX-4: live state is re-checked at redemption."""
    sid = new_session(store, repo)
    token, _ = issue(store, sid, config)
    set_state(store, sid, state)
    with pytest.raises(SessionTerminal):
        redeem(store, token, config)


def test_scope_refusals_at_redemption(store: Store, repo: Path, config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    token, _ = issue(store, sid, config)
    for host, path, protocol in [
        ("gitlab.com", "example/repo.git", "https"),
        ("github.com.evil.example", "example/repo.git", "https"),
        ("github.com", "example/other.git", "https"),
        ("github.com", "other/repo.git", "https"),
        ("github.com", "example/repo/../other", "https"),
        ("github.com", "example", "https"),
        ("github.com", "", "https"),
        ("github.com", "example/repo.git", "http"),
    ]:
        with pytest.raises(ScopeDenied):
            redeem(store, token, config, host=host, path=path, protocol=protocol)


def test_changed_repository_identity_is_refused(store: Store, repo: Path, config: CredentialsConfig) -> None:
    """LEASE-CTX-4: a scope taken from the origin must still be the origin at redemption."""
    sid = new_session(store, repo)
    token, _ = issue(store, sid, config)
    git("remote", "set-url", "origin", "https://github.com/example/elsewhere.git", cwd=repo)
    with pytest.raises(ScopeDenied, match="changed"):
        redeem(store, token, config)


def test_scope_at_issue(store: Store, tmp_path: Path, repo: Path, config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    with pytest.raises(ScopeDenied):  # not the workspace's origin
        issue(store, sid, config, LeaseScope.of("github.com", "example/other"))
    with pytest.raises(ScopeDenied):  # not github.com
        issue(store, sid, config, LeaseScope.of("gitlab.com", "example/repo"))
    token, _ = issue(store, sid, config, LeaseScope.of("github.com", "Example/Repo.git"))
    assert credential_snapshot(token)["scope_source"] == "origin"

    plain = new_session(store, tmp_path)  # not a git repository
    with pytest.raises(NotGitHubBacked):
        issue(store, plain, config)
    gitlab = new_session(store, make_repo(tmp_path / "gl", "git@gitlab.com:example/repo.git"))
    with pytest.raises(NotGitHubBacked):
        issue(store, gitlab, config)
    # "or the lease request names host github.com": a session without a GitHub origin
    token, _ = issue(store, plain, config, LeaseScope.of("github.com", "example/tool"))
    assert redeem(store, token, config, path="example/tool.git").repository == "example/tool"
    with pytest.raises(ScopeDenied):
        redeem(store, token, config, path="example/repo.git")


def test_unknown_forged_and_malformed_tokens_are_refused(store: Store, repo: Path,
                                                          config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    prefix_secret, claims, mac = token.split(".")
    forged_claims = json.loads(_unb64(claims))
    forged_claims["repo"] = "example/other"
    forged = ".".join([prefix_secret, _b64(json.dumps(forged_claims).encode()), mac])
    for bad in ["", "kgl_", "nonsense", "kgl_a.b.c", token + "x", forged, token.replace("kgl_", "kgc_"),
                "kgl_" + "A" * 5000]:
        with pytest.raises(LeaseInvalid):
            redeem(store, bad, config, path="example/other.git" if bad is forged else "example/repo.git")
    with store.session() as db:  # a valid signature whose row is gone is unknown
        db.delete(db.get(CredentialLease, lease_id))
    with pytest.raises(LeaseInvalid, match="unknown"):
        redeem(store, token, config)


def test_token_signed_by_another_installation_is_refused(tmp_path: Path, repo: Path,
                                                         config: CredentialsConfig) -> None:
    a = Store.open(sqlite_url(tmp_path / "a.db"))
    b = Store.open(sqlite_url(tmp_path / "b.db"))
    try:
        token, _ = issue(a, new_session(a, repo), config)
        issue(b, new_session(b, repo), config)
        with pytest.raises(LeaseInvalid, match="signature"):
            redeem(b, token, config)
    finally:
        a.close()
        b.close()


def test_signing_key_is_created_once_and_survives_a_restart(tmp_path: Path, repo: Path,
                                                            config: CredentialsConfig) -> None:
    """LEASE-CTX-5, LEASE-CTX-6: the key lives in the store, so a lease (and a capability)
    issued before a backend restart (Store closed and reopened) still redeems after it."""
    url = sqlite_url(tmp_path / "kandev.db")
    s = Store.open(url)
    ensure_signing_key(s.engine)
    with s.session() as db:
        key = db.get(Installation, SIGNING_KEY_NAME).value
    ensure_signing_key(s.engine)
    sid = new_session(s, repo)
    token, lease_id = issue(s, sid, config)
    with s.session() as db:
        cap = reissue_capability(db, token, now=T0)
    s.close()

    s2 = Store.open(url)  # the restart
    try:
        ensure_signing_key(s2.engine)
        with s2.session() as db:
            assert db.get(Installation, SIGNING_KEY_NAME).value == key
            assert len(bytes.fromhex(key)) == 32
        assert redeem(s2, token, config).lease_id == lease_id
        with s2.session() as db:
            new_token, _ = reissue_lease(db, cap, config=config, now=T0 + timedelta(minutes=5))
        redeem(s2, new_token, config, now=T0 + timedelta(minutes=6))
    finally:
        s2.close()


def test_key_is_created_lazily_when_the_start_did_not(store: Store, repo: Path, config: CredentialsConfig) -> None:
    with store.session() as db:
        assert db.get(Installation, SIGNING_KEY_NAME) is None
    token, _ = issue(store, new_session(store, repo), config)
    redeem(store, token, config)


def test_upstream_token_file_problems_fail_at_issue(store: Store, repo: Path, tmp_path: Path,
                                                    token_file: Path) -> None:
    sid = new_session(store, repo)
    with pytest.raises(CredentialsUnavailable, match="not set"):
        issue(store, sid, CredentialsConfig())
    with pytest.raises(CredentialsUnavailable, match="missing"):
        issue(store, sid, CredentialsConfig(github_token_file=str(tmp_path / "absent")))
    token_file.chmod(0o644)
    with pytest.raises(CredentialsUnavailable, match="bad_mode") as err:
        issue(store, sid, CredentialsConfig(github_token_file=str(token_file)))
    assert UPSTREAM not in str(err.value)
    token_file.chmod(0o600)
    token_file.write_text("two words\n")
    with pytest.raises(CredentialsUnavailable, match="exactly one token") as err:
        issue(store, sid, CredentialsConfig(github_token_file=str(token_file)))
    assert "two" not in str(err.value)


def test_rotated_upstream_token_takes_effect_without_a_restart(store: Store, repo: Path,
                                                               config: CredentialsConfig, token_file: Path) -> None:
    token, _ = issue(store, new_session(store, repo), config)
    token_file.write_text("ghp_rotated\n")
    assert redeem(store, token, config).password == "ghp_rotated"


def test_expired_rows_are_purged_later(store: Store, repo: Path, config: CredentialsConfig) -> None:
    sid = new_session(store, repo)
    _, old = issue(store, sid, config, now=T0)
    _, recent = issue(store, sid, config, now=T0 + timedelta(hours=2))
    _, _ = issue(store, sid, config, now=T0 + timedelta(hours=26))
    with store.session() as db:
        ids = set(db.scalars(select(CredentialLease.id)))
    assert old not in ids and recent in ids


# ---------------------------------------------------------------- reissue


def test_reissue_capability_gives_one_new_lease_for_the_same_scope(store: Store, repo: Path,
                                                                   config: CredentialsConfig) -> None:
    """LEASE-CTX-2, LEASE-CTX-3, LEASE-CTX-4: the capability is signed, scoped, and checked against live state."""
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    with store.session() as db:
        cap = reissue_capability(db, token, now=T0)
    assert cap.startswith("kgc_") and token not in cap
    later = T0 + timedelta(hours=2)
    with pytest.raises(LeaseExpired):
        redeem(store, token, config, now=later)
    with store.session() as db:
        new_token, new_id = reissue_lease(db, cap, config=config, now=later)
    assert new_id != lease_id
    r = redeem(store, new_token, config, now=later)
    assert (r.repository, r.session_id) == ("example/repo", sid)
    with pytest.raises(ScopeDenied):
        redeem(store, new_token, config, path="example/other.git", now=later)

    with store.session() as db, pytest.raises(CapabilityInvalid, match="expired"):
        reissue_lease(db, cap, config=config, now=T0 + timedelta(hours=25))
    _, claims_mac = cap.split("_", 1)
    claims, mac = claims_mac.split(".")
    forged = json.loads(_unb64(claims))
    forged["repo"] = "example/other"
    with store.session() as db, pytest.raises(CapabilityInvalid, match="signature"):
        reissue_lease(db, "kgc_" + _b64(json.dumps(forged).encode()) + "." + mac, config=config, now=later)
    set_state(store, sid, "FAILED")
    with store.session() as db, pytest.raises(SessionTerminal):
        reissue_lease(db, cap, config=config, now=later)
    set_state(store, sid, "STARTING")
    with store.session() as db:
        revoke_session_leases(db, sid)
    with store.session() as db, pytest.raises(CapabilityInvalid, match="revoked"):
        reissue_lease(db, cap, config=config, now=later)


# ---------------------------------------------------------------- snapshot and launch preparation


def test_snapshot_is_non_secret_and_stored_only_while_starting(store: Store, repo: Path,
                                                               config: CredentialsConfig) -> None:
    """RESUME-6 / RESUME-T4: the snapshot holds no secret, is stored while STARTING, and a new
    attempt's policy replaces the earlier one."""
    sid = new_session(store, repo)
    with store.session() as db:
        record_credential_snapshot(db, sid, {"policy": POLICY_NONE, "reason": "earlier attempt"})
    token, lease_id = issue(store, sid, config)
    snap = credential_snapshot(token)
    assert snap == {"policy": POLICY_GITHUB_LEASE, "host": "github.com", "repository": "example/repo",
                    "scope_source": "origin", "lease_id": lease_id, "issued_at": "2030-01-01T12:00:00Z",
                    "expires_at": "2030-01-01T13:00:00Z"}
    with store.session() as db:
        db.get(TaskSession, sid).metadata_json = {"acp": {"session_id": "keep-me"}}
    with store.session() as db:
        record_credential_snapshot(db, sid, snap)
    with store.session() as db:
        meta = db.get(TaskSession, sid).metadata_json
    assert meta == {"acp": {"session_id": "keep-me"}, SNAPSHOT_KEY: snap}
    assert token not in json.dumps(meta)
    set_state(store, sid, "WAITING_FOR_INPUT")
    with store.session() as db, pytest.raises(SessionNotStarting):
        record_credential_snapshot(db, sid, {"policy": POLICY_NONE})


def test_prepare_git_credentials_writes_a_private_lease_file_and_a_token_free_env(
        store: Store, repo: Path, tmp_path: Path, config: CredentialsConfig) -> None:
    paths = Paths.for_home(tmp_path / "home")
    paths.ensure()
    sid = new_session(store, repo)
    with store.session() as db:
        creds = prepare_git_credentials(db, sid, paths=paths, config=config)
    assert creds.policy == POLICY_GITHUB_LEASE and creds.snapshot["lease_id"] == creds.lease_id
    assert creds.lease_file == paths.home / "sessions" / sid / "git" / "lease.json"
    assert stat.S_IMODE(os.stat(creds.lease_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(creds.lease_file.parent).st_mode) == 0o700
    token, cap = read_lease_file(creds.lease_file)
    assert cap and token.startswith("kgl_")
    assert creds.env["KANDEV_GIT_LEASE_FILE"] == str(creds.lease_file)
    assert creds.env["KANDEV_BACKEND_SOCKET"] == str(paths.backend_socket)
    for value in creds.env.values():
        assert token not in value and cap not in value and UPSTREAM not in value
    assert redeem(store, token, config, now=datetime.now(UTC)).password == UPSTREAM

    with store.session() as db:  # a new attempt (resume) revokes the earlier attempt's lease
        again = prepare_git_credentials(db, sid, paths=paths, config=config)
    with pytest.raises(LeaseRevoked):
        redeem(store, token, config, now=datetime.now(UTC))
    new_token, _ = read_lease_file(again.lease_file)
    assert new_token != token and redeem(store, new_token, config, now=datetime.now(UTC)).password == UPSTREAM

    plain = new_session(store, tmp_path / "home")
    with store.session() as db:
        none = prepare_git_credentials(db, plain, paths=paths, config=config)
    assert none.policy == POLICY_NONE and none.env == {} and none.lease_id is None
    with store.session() as db:
        unset = prepare_git_credentials(db, sid, paths=paths, config=CredentialsConfig())
    assert unset.policy == POLICY_NONE and "github_token_file" in unset.snapshot["reason"]
    # Issue 20 item 4: GitHub-backed without a token, git is still routed to kandev's transport,
    # whose lease file holds only the reason (the setting to fix), never a lease.
    assert unset.lease_id is None and int(unset.env["GIT_CONFIG_COUNT"]) > 0
    with pytest.raises(helper.HelperError) as no_token:
        helper.valid_lease(unset.env["KANDEV_GIT_LEASE_FILE"], "/nowhere", "github.com", "o/r.git")
    assert no_token.value.code == "credentials_unavailable" and "credentials.github_token_file" in no_token.value.message
    set_state(store, sid, "CANCELLED")
    with store.session() as db, pytest.raises(SessionTerminal):
        prepare_git_credentials(db, sid, paths=paths, config=CredentialsConfig())


def test_no_secret_reaches_the_log(store: Store, repo: Path, config: CredentialsConfig,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sid = new_session(store, repo)
    token, lease_id = issue(store, sid, config)
    with store.session() as db:
        cap = reissue_capability(db, token, now=T0)
    redeem(store, token, config)
    with pytest.raises(ScopeDenied):
        redeem(store, token, config, path="example/other.git")
    with store.session() as db:
        reissue_lease(db, cap, config=config, now=T0)
    events = [getattr(r, "kandev_event", None) for r in caplog.records]
    assert {"credential_lease_issued", "credential_redeemed", "credential_refused"} <= set(events)
    text_out = "\n".join(r.getMessage() + repr(getattr(r, "kandev_fields", {})) for r in caplog.records)
    assert lease_id in text_out
    for secret in (token, token.split(".")[0][4:], cap, UPSTREAM):
        assert secret not in text_out

