"""Git credential leases end to end (Issue 5 scenario C): a real backend process, a task whose
workspace is a real git repository with origin ``https://github.com/example/repo.git``, and the
lease checked the way the agent's git transport checks it before each fetch or push
(``daemon.git_credential_helper.valid_lease`` over the backend's socket; no network is needed).
Since Issue 20 the redemption gives no upstream credential (the session's git endpoint uses the
token, tests/integration/test_git_endpoint.py) and ``git credential fill`` in the agent's
environment gets none.

``test_scenario_c_real_resume_of_a_failed_github_session`` runs the scenario through the real
daemons: ``kandev session start`` / ``kandev resume`` issue the lease and the mock agent checks it with its
session's credential endpoint (prompt ``/git-credential``). The other
tests drive the broker in this process on the backend's own store (what the backend does in its
process), with the session moved to STARTING through the guarded transition first (RESUME-5,
RESUME-9, LEASE-CTX-7), to reach expiry, revocation and scope cases directly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.config.settings import CredentialsConfig
from daemon.credentials import (
    SNAPSHOT_KEY,
    SessionTerminal,
    issue_lease,
    lease_file_path,
    prepare_git_credentials,
    read_lease_file,
    record_credential_snapshot,
)
from daemon.git_credential_helper import LEASE_FILE_ENV, SOCKET_ENV, HelperError, valid_lease
from daemon.host.paths import Paths
from daemon.store import transitions
from daemon.store.db import Store, sqlite_url
from daemon.store.models import CredentialLease, TaskSession, new_id
from tests.support.kandev import Kandev, db_row
from tests.support.processes import alive
from tests.support.sessions import metadata
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

UPSTREAM = "ghp_INTEGRATIONupstreamToken0123456789abcd"
FILL = "protocol=https\nhost=github.com\npath=example/repo.git\n\n"


@dataclass
class Setup:
    k: Kandev
    repo: Path
    token_file: Path
    config: CredentialsConfig
    paths: Paths
    task_id: str
    git_home: Path

    def store(self) -> Store:
        return Store.open(sqlite_url(self.k.home / "kandev.db"))

    def starting_session(self) -> str:
        """A session of the task, moved CREATED -> STARTING through the guarded transition."""
        sid = new_id()
        s = self.store()
        try:
            with s.session() as db:
                db.add(TaskSession(id=sid, task_id=self.task_id, agent="mock", state="CREATED", metadata_json={}))
                db.flush()
                transitions.transition_session(db, sid, "STARTING", expected_from={"CREATED"}, reason="resume")
        finally:
            s.close()
        return sid

    def transition(self, sid: str, to: str, expected: str) -> None:
        s = self.store()
        try:
            with s.session() as db:
                transitions.transition_session(db, sid, to, expected_from={expected}, reason="test")
        finally:
            s.close()

    def git(self, env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        """Real git as the agent runs it: the agent's env plus the broker's variables, in the repo."""
        full = {k: v for k, v in self.k.env.items() if not k.startswith("GIT_")}
        full["HOME"] = str(self.git_home)  # a user config with credential.helper=store (see below)
        full.update(env)
        return subprocess.run(["git", *args], input=stdin, capture_output=True, text=True, env=full,
                              cwd=self.repo, timeout=60)


@pytest.fixture
def setup(kandev_factory: Any, short_tmp: Path) -> Iterator[Setup]:
    token_file = short_tmp / "github-token"
    token_file.write_text(UPSTREAM + "\n")
    token_file.chmod(0o600)
    repo = short_tmp / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=30)
    subprocess.run(["git", "remote", "add", "origin", "https://github.com/example/repo.git"], cwd=repo, check=True,
                   timeout=30)
    for_agent(repo)
    git_home = short_tmp / "gituser"
    git_home.mkdir()
    # A user-level helper that would write any credential it is given to ~/.git-credentials:
    # the agent env must reset the helper list for github.com so it never sees the upstream token.
    (git_home / ".gitconfig").write_text("[credential]\n\thelper = store\n")
    k = kandev_factory("home", f'[credentials]\ngithub_token_file = "{token_file}"\nlease_ttl = "1h"\n')
    k.up()
    task_id = k.cli("task", "create", "--title", "gh", "--workspace", str(repo))["task_id"]
    yield Setup(k, repo, token_file, CredentialsConfig(github_token_file=str(token_file), lease_ttl=3600.0),
                Paths.for_home(k.home), task_id, git_home)


def prepare(setup: Setup, sid: str) -> Any:
    s = setup.store()
    try:
        with s.session() as db:
            creds = prepare_git_credentials(db, sid, paths=setup.paths, config=setup.config)
            record_credential_snapshot(db, sid, creds.snapshot)  # RESUME-6: while STARTING, before launch
        return creds
    finally:
        s.close()


def fill_ok(setup: Setup, env: dict[str, str], path: str = "example/repo.git") -> str:
    """The lease checked as the agent's git transport checks it: the (possibly reissued) lease token."""
    return valid_lease(env[LEASE_FILE_ENV], env[SOCKET_ENV], "github.com", path)


def fill_refused(setup: Setup, env: dict[str, str], code: str, path: str = "example/repo.git") -> None:
    with pytest.raises(HelperError) as err:
        fill_ok(setup, env, path)
    assert err.value.code == code and UPSTREAM not in str(err.value), err.value


def kill_backend(k: Kandev) -> None:
    pid = k.backend_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), timeout=30)


def test_git_authenticates_through_the_shipped_helper_and_the_lease_survives_a_restart(setup: Setup) -> None:
    """Issue 5 scenario C / RESUME-5, RESUME-6, RESUME-9, LEASE-CTX-5, LEASE-CTX-6: STARTING is persisted, then the
    lease is issued and redeems; git run with ``agent_git_env`` gets no credential at all
    (Issue 20 scenario A: no helper answers, a user-level ``store`` helper is never asked); the snapshot is
    stored; after the backend is SIGKILLed and started again the same lease still redeems
    (signing key and hash are in the store)."""
    sid = setup.starting_session()
    creds = prepare(setup, sid)
    assert creds.policy == "github-lease"
    token, capability = read_lease_file(creds.lease_file)
    for value in creds.env.values():  # the agent env names a file and a socket, never a secret
        assert token not in value and capability not in value and UPSTREAM not in value

    assert fill_ok(setup, creds.env) == token
    p = setup.git(creds.env, "credential", "fill", stdin=FILL)
    assert p.returncode != 0 and "password=" not in p.stdout and UPSTREAM not in p.stdout + p.stderr
    approve = setup.git(creds.env, "credential", "approve",
                        stdin=FILL.replace("\n\n", "\nusername=someone\npassword=typed-by-the-agent\n\n"))
    assert approve.returncode == 0, approve.stderr
    assert not (setup.git_home / ".git-credentials").exists()
    # Without the agent env the user's helper would have been used: the reset is what prevents it.

    s = setup.store()
    try:
        with s.session() as db:
            snap = db.get(TaskSession, sid).metadata_json[SNAPSHOT_KEY]
    finally:
        s.close()
    assert snap["policy"] == "github-lease" and snap["lease_id"] == creds.lease_id
    assert (snap["host"], snap["repository"]) == ("github.com", "example/repo")

    # A path outside the lease's scope is refused by the backend.
    fill_refused(setup, creds.env, "scope_denied", "example/other.git")

    kill_backend(setup.k)
    setup.k.up()
    fill_ok(setup, creds.env)
    assert read_lease_file(creds.lease_file) == (token, capability)  # the same lease, not a reissued one
    assert setup.k.cli("session", "show", sid)["state"] not in ("COMPLETED", "FAILED", "CANCELLED")


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED"])
def test_terminal_sessions_get_no_lease_and_redeem_none(setup: Setup, state: str) -> None:
    """RESUME-9: a lease for a FAILED or CANCELLED session is refused at issue, and a lease whose
    session became terminal no longer redeems through git."""
    sid = setup.starting_session()
    setup.transition(sid, state, "STARTING")
    s = setup.store()
    try:
        with s.session() as db, pytest.raises(SessionTerminal):
            issue_lease(db, sid, config=setup.config)
    finally:
        s.close()

    live = setup.starting_session()
    creds = prepare(setup, live)
    fill_ok(setup, creds.env)
    setup.transition(live, state, "STARTING")
    fill_refused(setup, creds.env, "session_terminal")


def test_expired_lease_is_reissued_once_with_the_capability(setup: Setup) -> None:
    """LEASE-CTX-3: the helper's one reissue after lease_expired, re-checked against live state;
    the new lease is written back to the lease file; revoked leases end the capability."""
    sid = setup.starting_session()
    creds = prepare(setup, sid)
    old_token, capability = read_lease_file(creds.lease_file)
    s = setup.store()
    try:
        with s.session() as db:
            db.get(CredentialLease, creds.lease_id).expires_at = datetime.now(UTC) - timedelta(seconds=1)
    finally:
        s.close()
    fill_ok(setup, creds.env)
    new_token, same_cap = read_lease_file(creds.lease_file)
    assert new_token != old_token and same_cap == capability

    s = setup.store()
    try:
        with s.session() as db:
            for row in db.query(CredentialLease).filter_by(session_id=sid):
                row.revoked = True
    finally:
        s.close()
    fill_refused(setup, creds.env, "capability_invalid")


def test_redemption_log_lines_never_contain_a_secret(setup: Setup) -> None:
    """The backend's log (journal fields rendered as lines in <home>/logs/backend.log when there is
    no journald) records issue, redemption and refusal by lease id, never the lease token, the
    capability or the upstream token."""
    sid = setup.starting_session()
    creds = prepare(setup, sid)
    token, capability = read_lease_file(creds.lease_file)
    fill_ok(setup, creds.env)
    fill_refused(setup, creds.env, "scope_denied", "example/other.git")
    log = (setup.k.home / "logs" / "backend.log").read_text()
    lines = [line for line in log.splitlines() if "credential_" in line]
    assert any("credential_redeemed" in line and creds.lease_id in line for line in lines), log[-2000:]
    assert any("credential_refused" in line and "scope_denied" in line for line in lines)
    for secret in (token, token.split(".")[0], capability, UPSTREAM):
        assert secret not in log


def _agent_says(k: Kandev, sid: str, prompt: str) -> str:
    k.cli("prompt", sid, prompt, "--wait")
    return [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]


def test_scenario_c_real_resume_of_a_failed_github_session(setup: Setup) -> None:
    """Issue 5 scenario C end to end through the real daemons, RESUME-5, RESUME-6, RESUME-9: a GitHub-backed
    session gets its lease at start and the agent's own ``git`` authenticates through the shipped
    helper; the session FAILS; ``kandev resume`` persists STARTING before the broker issues the
    new lease, the snapshot names that lease, and git run by the resumed agent authenticates
    again; the first attempt's lease is revoked and a lease for the FAILED session is refused."""
    k = setup.k
    ok = "git-credential: ok repository=github.com/example/repo lease-sha256="
    sid = k.cli("session", "start", setup.task_id)["session_id"]
    assert _agent_says(k, sid, "/git-credential").startswith(ok)
    first = metadata(k, sid)[SNAPSHOT_KEY]
    assert first["policy"] == "github-lease" and first["repository"] == "example/repo"

    k.cli("prompt", sid, "/exit 2")
    wait_until(lambda: k.show(sid)["state"] == "FAILED", timeout=30)
    s = setup.store()
    try:
        with s.session() as db, pytest.raises(SessionTerminal):  # RESUME-9: no lease for a FAILED session
            issue_lease(db, sid, config=setup.config)
    finally:
        s.close()

    resumed = k.cli("resume", sid)
    assert resumed["state"] == "WAITING_FOR_INPUT" and resumed["credential_policy"] == "github-lease"
    snapshot = metadata(setup.k, sid)[SNAPSHOT_KEY]
    assert snapshot["policy"] == "github-lease" and snapshot["lease_id"] != first["lease_id"]
    log = (k.home / "logs" / "backend.log").read_text()
    starting = log.index(f"session {sid} FAILED -> STARTING (resume)")
    issued = log.index(f"git credential lease {snapshot['lease_id']} issued to session {sid}")
    assert starting < issued  # RESUME-5: STARTING is durable before the lease is asked for
    assert _agent_says(k, sid, "/git-credential").startswith(ok)
    assert _lease_revoked(setup, first["lease_id"]) and not _lease_revoked(setup, snapshot["lease_id"])
    for text in (log, *(p.read_text() for p in (k.home / "logs" / "agents").glob("*.log"))):
        assert UPSTREAM not in text


def test_a_session_without_a_github_remote_starts_without_a_lease(setup: Setup, short_tmp: Path) -> None:
    """The policy is ``none`` (and says why) when the workspace is not GitHub-backed: no lease, and
    the agent's git finds no credential from kandev."""
    plain = short_tmp / "plain"
    plain.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=plain, check=True, timeout=30)
    subprocess.run(["git", "remote", "add", "origin", "https://gitlab.example/x/y.git"], cwd=plain, check=True,
                   timeout=30)
    for_agent(plain)
    task = setup.k.cli("task", "create", "--title", "plain", "--workspace", str(plain))["task_id"]
    sid = setup.k.cli("session", "start", task)["session_id"]
    snapshot = metadata(setup.k, sid)[SNAPSHOT_KEY]
    assert snapshot["policy"] == "none" and snapshot.get("lease_id") is None
    said = _agent_says(setup.k, sid, "/git-credential")
    assert said.startswith("git-credential: failed"), said


def _lease_revoked(setup: Setup, lease_id: str) -> bool:
    row = db_row(setup.k, "SELECT revoked FROM credential_leases WHERE id = ?", lease_id)
    assert row is not None
    return bool(row["revoked"])


_FD_OPTIONS = {"--userns", "--userns2", "--seccomp"}
"""bwrap options whose value is a descriptor number of the control server: which number the
kernel hands out depends on what else the server has open at that moment, not on the session."""
_EGRESS_DIR = re.compile(r"/run/egress/[0-9a-f]{32}(?=/|$)")
"""An agent's egress proxy socket directory is named after its instance (Issue 44): a restarted
agent is a new instance with a directory of its own, the same in every other respect."""


def _process_facts(pid: int) -> tuple[list[str], str, dict[str, str]]:
    """(argv, cwd, environment) of a running agent process; descriptor numbers in argv as ``<fd>``."""
    proc = psutil.Process(pid)
    argv = proc.cmdline()
    argv = [("<fd>" if i and argv[i - 1] in _FD_OPTIONS else _EGRESS_DIR.sub("/run/egress/<instance>", a))
            for i, a in enumerate(argv)]
    return argv, proc.cwd(), proc.environ()


@pytest.mark.parametrize("restart", [False, True], ids=["acp", "restart"])
def test_a_context_reset_changes_nothing_else(setup: Setup, restart: bool) -> None:
    """RESETCFG-13: a context reset (the ACP fast path, and the process-restart fallback) changes
    the provider session and nothing else: the same agent and executor, the same command line,
    working directory and environment, the same git lease (no new one issued, the lease file
    untouched) and git still authenticating through it."""
    k = setup.k
    sid = k.cli("session", "start", setup.task_id)["session_id"]
    k.cli("session", "configure", sid, "--model", "mock-smart", "--mode", "plan", "--option", "effort=high")
    before, meta_before = k.show(sid), metadata(setup.k, sid)
    lease_file = lease_file_path(setup.paths, sid)
    lease_bytes = lease_file.read_bytes()
    facts_before = _process_facts(before["agent_pid"])

    reset = k.cli("session", "reset-context", sid, *(["--restart"] if restart else []))
    assert reset["path"] == ("restart" if restart else "acp")
    after, meta_after = k.show(sid), metadata(setup.k, sid)
    assert after["state"] == "WAITING_FOR_INPUT" and after["runtime_config"] == before["runtime_config"]
    assert (after["agent"], after["task_id"]) == (before["agent"], before["task_id"])
    assert (after["agent_pid"] == before["agent_pid"]) is (not restart)
    assert _process_facts(after["agent_pid"]) == facts_before
    assert meta_after[SNAPSHOT_KEY] == meta_before[SNAPSHOT_KEY]  # the same lease: none was issued
    assert lease_file.read_bytes() == lease_bytes
    assert _agent_says(k, sid, "/git-credential").startswith(
        "git-credential: ok repository=github.com/example/repo lease-sha256=")
    assert not _lease_revoked(setup, meta_before[SNAPSHOT_KEY]["lease_id"])


def test_a_start_whose_credentials_are_refused_fails_and_does_not_stay_starting(setup: Setup) -> None:
    """RESUME-7's rule for a first start too: a failure after STARTING (here the broker refuses a
    token file others may read) leaves the session FAILED with the reason, never STARTING, and no
    agent was launched; once fixed, a new start gets its lease."""
    k = setup.k
    setup.token_file.chmod(0o644)
    proc = k.run("session", "start", setup.task_id)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["error"]["code"] == "credentials_unavailable"
    (session,) = k.cli("session", "list")["sessions"]
    show = k.show(session["session_id"])
    assert show["state"] == "FAILED" and "git credentials" in show["last_error"] and not show["agent_pid"]
    setup.token_file.chmod(0o600)
    sid = k.cli("session", "start", setup.task_id)["session_id"]
    assert metadata(setup.k, sid)[SNAPSHOT_KEY]["policy"] == "github-lease"
