"""The agent side of the git lease (Issue 5, Issue 20): the lease file's permissions, one
reissue attempt only after a lease failure (LEASE-CTX-3), an environment that names files and
sockets but never holds a secret, and git configuration that routes GitHub URLs to kandev's
transport with no credential helper answering."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon import git_credential_helper as helper
from daemon.credentials import (
    REISSUABLE_CODES,
    agent_git_env,
    read_lease_file,
    transport_command,
    write_lease_file,
)
from daemon.host.paths import write_secret_file
from ipc.errors import IpcError

HOST, PATH = "github.com", "example/repo.git"


@pytest.fixture
def lease(tmp_path: Path) -> Path:
    return write_lease_file(tmp_path / "leases" / "s.json", "kgl_old", "kgc_cap")


def check(lease_file: Path | str, socket: str = "/x") -> str:
    return helper.valid_lease(str(lease_file), socket, HOST, PATH)


def test_reissuable_codes_match_the_broker() -> None:
    assert helper.REISSUABLE_CODES == REISSUABLE_CODES


def _pairs(env: dict[str, str]) -> list[tuple[str, str]]:
    return [(env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"]) for i in range(int(env["GIT_CONFIG_COUNT"]))
            if f"GIT_CONFIG_KEY_{i}" in env]


def test_agent_git_env_routes_github_through_the_transport_with_no_helper(tmp_path: Path) -> None:
    """Issue 20 scenario A: GitHub URLs are rewritten to kandev's transport (ext::, user-initiated
    only), no credential helper answers for the host, and the env holds paths, never a secret."""
    env = agent_git_env(tmp_path / "lease.json", tmp_path / "ep" / "git.sock")
    assert env["KANDEV_GIT_LEASE_FILE"] == str(tmp_path / "lease.json")
    assert env["KANDEV_BACKEND_SOCKET"] == str(tmp_path / "ep" / "git.sock")
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    ext = transport_command(tmp_path / "ep" / "git-proxy.sock", tmp_path / "ep" / "git.sock",
                            tmp_path / "lease.json", "github.com")
    assert _pairs(env) == [
        ("protocol.ext.allow", "user"),
        ("credential.https://github.com.helper", ""),
        (f"url.{ext}.insteadOf", "https://github.com/"),
        (f"url.{ext}.insteadOf", "git@github.com:"),
        (f"url.{ext}.insteadOf", "ssh://git@github.com/"),
    ]
    assert ext.startswith(f"ext::{os.path.abspath(sys.executable)} -I -m daemon.git_transport ")
    assert ext.endswith(" github.com %S ")
    assert transport_command("/a b/p.sock", "/c%d", "/l", "h", python="/py") == "ext::/py -I -m daemon.git_transport /a% b/p.sock /c%%d /l h %S "


def test_agent_git_env_adds_a_github_enterprise_host(tmp_path: Path) -> None:
    env = agent_git_env("/l", "/e/git.sock", github_url="https://GHE.example.com:8443/prefix")
    keys = _pairs(env)
    assert ("credential.https://ghe.example.com.helper", "") in keys
    assert sum(1 for k, v in keys if v == "https://ghe.example.com/") == 1
    assert any(" ghe.example.com %S " in k for k, _ in keys)


def test_agent_git_env_appends_to_existing_git_config_entries(tmp_path: Path) -> None:
    env = agent_git_env("/l", "/s", base_env={"GIT_CONFIG_COUNT": "2"})
    assert env["GIT_CONFIG_COUNT"] == "7" and "GIT_CONFIG_KEY_0" not in env
    assert env["GIT_CONFIG_KEY_2"] == "protocol.ext.allow"
    assert agent_git_env("/l", "/s", base_env={"GIT_CONFIG_COUNT": "junk"})["GIT_CONFIG_COUNT"] == "5"


def test_lease_file_is_private_and_checked(tmp_path: Path) -> None:
    path = write_lease_file(tmp_path / "d" / "lease.json", "kgl_x", "kgc_y")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert read_lease_file(path) == ("kgl_x", "kgc_y")
    write_lease_file(path, "kgl_z")
    assert read_lease_file(path) == ("kgl_z", None)
    bare = tmp_path / "bare"
    write_secret_file(bare, b"kgl_bare\n")
    assert read_lease_file(bare) == ("kgl_bare", None)
    path.chmod(0o644)
    with pytest.raises(helper.HelperError) as err:
        check(path)
    assert err.value.code == "lease_file" and "0644" in str(err.value) and "kgl_z" not in str(err.value)


def test_missing_host_or_path_fails_closed(lease: Path) -> None:
    with pytest.raises(helper.HelperError) as err:
        helper.valid_lease(str(lease), "/x", HOST, "")
    assert err.value.code == "invalid_argument"


class FakeBackend:
    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, socket_path: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((op, dict(args)))
        answer = self.answers.pop(0)
        if isinstance(answer, IpcError):
            raise answer
        return answer


def test_a_checked_lease_is_returned_and_no_credential_is_asked_for(lease: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBackend([{"lease_id": "l1", "host": HOST, "repository": "example/repo"}])
    monkeypatch.setattr(helper, "_call", fake)
    assert check(lease) == "kgl_old"
    assert fake.calls == [("credential_redeem", {"lease_token": "kgl_old", "host": "github.com",
                                                 "path": "example/repo.git", "protocol": "https"})]
    fake = FakeBackend([{"username": "x", "password": "y"}])  # an answer without a lease id is refused
    monkeypatch.setattr(helper, "_call", fake)
    with pytest.raises(helper.HelperError):
        check(lease)


@pytest.mark.parametrize("code", sorted(REISSUABLE_CODES))
def test_one_reissue_after_a_lease_failure(code: str, lease: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LEASE-CTX-3: at most one reissue per request, only on lease-invalid/expired/revoked, then one
    more redemption; the new lease is written back to the file."""
    fake = FakeBackend([IpcError(code, "x"), {"lease_token": "kgl_new", "lease_id": "l2"}, {"lease_id": "l2"}])
    monkeypatch.setattr(helper, "_call", fake)
    assert check(lease) == "kgl_new"
    assert [c[0] for c in fake.calls] == ["credential_redeem", "credential_reissue", "credential_redeem"]
    assert fake.calls[1][1] == {"capability": "kgc_cap"} and fake.calls[2][1]["lease_token"] == "kgl_new"
    assert read_lease_file(lease) == ("kgl_new", "kgc_cap")

    fake = FakeBackend([IpcError(code, "x"), {"lease_token": "kgl_3", "lease_id": "l3"}, IpcError(code, "again")])
    monkeypatch.setattr(helper, "_call", fake)
    with pytest.raises(helper.HelperError) as err:
        check(lease)
    assert len(fake.calls) == 3 and err.value.code == code


@pytest.mark.parametrize("code", ["session_terminal", "scope_denied", "credentials_unavailable", "unavailable",
                                  "invalid_argument"])
def test_other_failures_are_final(code: str, lease: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBackend([IpcError(code, "refused")])
    monkeypatch.setattr(helper, "_call", fake)
    with pytest.raises(helper.HelperError) as err:
        check(lease)
    assert f"{code}: refused" in str(err.value) and len(fake.calls) == 1


def test_no_reissue_without_a_capability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    only = write_lease_file(tmp_path / "l" / "s.json", "kgl_only")
    fake = FakeBackend([IpcError("lease_expired", "expired")])
    monkeypatch.setattr(helper, "_call", fake)
    with pytest.raises(helper.HelperError):
        check(only)
    assert len(fake.calls) == 1


def test_unreachable_backend_fails_closed(lease: Path) -> None:
    with pytest.raises(helper.HelperError) as err:
        check(lease)  # nothing listens on the socket
    assert err.value.code == "unavailable" and "kgl_old" not in str(err.value)
