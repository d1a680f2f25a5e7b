"""The shipped git credential helper and the agent environment (Issue 5): git's helper protocol,
no-op store/erase, one reissue attempt only after a lease failure (LEASE-CTX-3), the lease file's
permissions, and an environment that names files and sockets but never holds a secret."""

from __future__ import annotations

import io
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon import git_credential_helper as helper
from daemon.credentials import (
    REISSUABLE_CODES,
    agent_git_env,
    helper_command,
    read_lease_file,
    write_lease_file,
)
from daemon.paths import write_secret_file
from ipc.errors import IpcError


def run_helper(argv: list[str], stdin: str, env: dict[str, str]) -> tuple[int, str, str]:
    """The git credential helper's main, in process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = helper.main(argv, stdin=io.StringIO(stdin), stdout=out, stderr=err, env=env)
    return code, out.getvalue(), err.getvalue()


GET = "protocol=https\nhost=github.com\npath=example/repo.git\n\n"


@pytest.fixture
def lease_env(tmp_path: Path) -> dict[str, str]:
    lease = write_lease_file(tmp_path / "leases" / "s.json", "kgl_old", "kgc_cap")
    return {"KANDEV_GIT_LEASE_FILE": str(lease), "KANDEV_BACKEND_SOCKET": str(tmp_path / "backend.sock")}


def test_reissuable_codes_match_the_broker() -> None:
    assert helper.REISSUABLE_CODES == REISSUABLE_CODES


def test_agent_git_env_routes_github_to_the_helper_only(tmp_path: Path) -> None:
    env = agent_git_env(tmp_path / "lease.json", tmp_path / "backend.sock")
    assert env["KANDEV_GIT_LEASE_FILE"] == str(tmp_path / "lease.json")
    assert env["KANDEV_BACKEND_SOCKET"] == str(tmp_path / "backend.sock")
    assert env["GIT_TERMINAL_PROMPT"] == "0"
    pairs = [(env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"]) for i in range(int(env["GIT_CONFIG_COUNT"]))]
    assert pairs == [
        ("credential.https://github.com.helper", ""),
        ("credential.https://github.com.helper", helper_command()),
        ("credential.https://github.com.useHttpPath", "true"),
    ]
    cmd = helper_command()
    assert cmd.startswith("!") and shlex.split(cmd[1:]) == [os.path.abspath(sys.executable), "-I", "-m",
                                                           "daemon.git_credential_helper"]
    assert helper_command("/opt/my python/bin/python3") == "!'/opt/my python/bin/python3' -I -m daemon.git_credential_helper"


def test_agent_git_env_appends_to_existing_git_config_entries(tmp_path: Path) -> None:
    env = agent_git_env("/l", "/s", base_env={"GIT_CONFIG_COUNT": "2"})
    assert env["GIT_CONFIG_COUNT"] == "5" and "GIT_CONFIG_KEY_0" not in env
    assert env["GIT_CONFIG_KEY_2"] == "credential.https://github.com.helper"
    assert agent_git_env("/l", "/s", base_env={"GIT_CONFIG_COUNT": "junk"})["GIT_CONFIG_COUNT"] == "3"


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
    code, out, err = run_helper(["get"], GET, {"KANDEV_GIT_LEASE_FILE": str(path), "KANDEV_BACKEND_SOCKET": "/x"})
    assert code == 1 and out == "quit=1\n" and "0644" in err and "kgl_z" not in err


@pytest.mark.parametrize("action", ["store", "erase", "unknown-action"])
def test_store_and_erase_keep_nothing(action: str, tmp_path: Path, lease_env: dict[str, str]) -> None:
    before = Path(lease_env["KANDEV_GIT_LEASE_FILE"]).read_bytes()
    code, out, err = run_helper([action], GET.replace("\n\n", "\nusername=x-access-token\npassword=UPSTREAM\n\n"),
                         lease_env)
    assert (code, out, err) == (0, "", "")
    assert Path(lease_env["KANDEV_GIT_LEASE_FILE"]).read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["s.json"]


@pytest.mark.parametrize("request_text", [
    "protocol=https\nhost=gitlab.com\npath=a/b\n\n",
    "protocol=http\nhost=github.com\npath=a/b\n\n",
    "protocol=ssh\nhost=github.com\n\n",
    "",
])
def test_requests_for_other_hosts_get_an_empty_answer(request_text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helper, "_call", lambda *a: pytest.fail("must not call the backend"))
    assert run_helper(["get"], request_text, {}) == (0, "", "")


def test_missing_environment_or_path_fails_closed(lease_env: dict[str, str]) -> None:
    code, out, err = run_helper(["get"], GET, {})
    assert code == 1 and out == "quit=1\n" and "KANDEV_GIT_LEASE_FILE" in err
    code, out, err = run_helper(["get"], "protocol=https\nhost=github.com\n\n", lease_env)
    assert code == 1 and "useHttpPath" in err


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


def test_get_prints_the_redeemed_credential(lease_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBackend([{"username": "x-access-token", "password": "UPSTREAM"}])
    monkeypatch.setattr(helper, "_call", fake)
    code, out, err = run_helper(["get"], GET, lease_env)
    assert (code, out, err) == (0, "username=x-access-token\npassword=UPSTREAM\n", "")
    assert fake.calls == [("credential_redeem", {"lease_token": "kgl_old", "host": "github.com",
                                                 "path": "example/repo.git", "protocol": "https"})]


@pytest.mark.parametrize("code", sorted(REISSUABLE_CODES))
def test_one_reissue_after_a_lease_failure(code: str, lease_env: dict[str, str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """LEASE-CTX-3: at most one reissue per request, only on lease-invalid/expired/revoked, then one
    more redemption; the new lease is written back to the file."""
    fake = FakeBackend([IpcError(code, "x"), {"lease_token": "kgl_new", "lease_id": "l2"},
                        {"username": "x-access-token", "password": "UPSTREAM"}])
    monkeypatch.setattr(helper, "_call", fake)
    rc, out, _ = run_helper(["get"], GET, lease_env)
    assert rc == 0 and out.endswith("password=UPSTREAM\n")
    assert [c[0] for c in fake.calls] == ["credential_redeem", "credential_reissue", "credential_redeem"]
    assert fake.calls[1][1] == {"capability": "kgc_cap"} and fake.calls[2][1]["lease_token"] == "kgl_new"
    assert read_lease_file(lease_env["KANDEV_GIT_LEASE_FILE"]) == ("kgl_new", "kgc_cap")

    fake = FakeBackend([IpcError(code, "x"), {"lease_token": "kgl_3", "lease_id": "l3"}, IpcError(code, "again")])
    monkeypatch.setattr(helper, "_call", fake)
    rc, out, err = run_helper(["get"], GET, lease_env)
    assert rc == 1 and out == "quit=1\n" and len(fake.calls) == 3 and code in err


@pytest.mark.parametrize("code", ["session_terminal", "scope_denied", "credentials_unavailable", "unavailable",
                                  "invalid_argument"])
def test_other_failures_are_final(code: str, lease_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBackend([IpcError(code, "refused")])
    monkeypatch.setattr(helper, "_call", fake)
    rc, out, err = run_helper(["get"], GET, lease_env)
    assert (rc, out) == (1, "quit=1\n") and f"{code}: refused" in err and len(fake.calls) == 1


def test_no_reissue_without_a_capability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lease = write_lease_file(tmp_path / "l" / "s.json", "kgl_only")
    fake = FakeBackend([IpcError("lease_expired", "expired")])
    monkeypatch.setattr(helper, "_call", fake)
    rc, _, _ = run_helper(["get"], GET, {"KANDEV_GIT_LEASE_FILE": str(lease), "KANDEV_BACKEND_SOCKET": "/x"})
    assert rc == 1 and len(fake.calls) == 1


def test_unreachable_backend_fails_closed(lease_env: dict[str, str]) -> None:
    rc, out, err = run_helper(["get"], GET, lease_env)  # nothing listens on the socket
    assert rc == 1 and out == "quit=1\n" and "unavailable" in err and "kgl_old" not in err
