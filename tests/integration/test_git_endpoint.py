"""No standing secret inside a sandbox (Issue 20 scenario A, Issue 20 scenario B, Issue 20 scenario C,
Issue 20 scenario D and Issue 20 scenario E) through the real daemons.

Each test runs the real backend, control server and sandboxed mock agent, with
``credentials.github_token_file`` set and ``credentials.github_url`` pointing at a local
smart-HTTP stand-in (tests/support/git_standin.py: the real ``git http-backend`` behind a loopback
HTTP server that accepts only the configured token and logs every request). The task's workspace
is a clone whose ``origin`` is ``https://github.com/example/repo.git``; the agent runs the real
``git`` through ``/sh`` (the way an agent's terminal tool does), with the git configuration kandev
gives it, and so reaches the stand-in only through its session's git endpoint.
"""

from __future__ import annotations

import codecs
import os
import re
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.credentials import read_lease_file, write_lease_file
from daemon.git_credential_helper import HelperError, valid_lease
from daemon.host.paths import Paths
from daemon.host.session_dirs import SessionDirs
from tests.support.git_standin import GitStandin
from tests.support.kandev import Kandev
from tests.support.processes import alive, cmdline
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

# Made at run time: the source (bound read-only into every sandbox) must not hold it.
TOKEN = "ghp_" + secrets.token_hex(18)
REMOTE = "https://github.com/example/repo.git"
GIT_ID = "GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@e GIT_COMMITTER_NAME=a GIT_COMMITTER_EMAIL=a@e"


@dataclass
class Setup:
    k: Kandev
    standin: GitStandin
    workspace: Path
    token_file: Path
    task_id: str
    tmp: Path

    def start(self) -> str:
        return str(self.k.cli("session", "start", self.task_id)["session_id"])


def _config(token_file: Path, url: str, extra: str = "") -> str:
    return (f'[features]\nagent_survival = true\n[credentials]\ngithub_token_file = "{token_file}"\n'
            f'github_url = "{url}"\n{extra}')


def _read_lease(path: Path) -> tuple[str, str | None]:
    """The session's lease as its agent reads it. The file is the agent's uid's (0600), and
    ``read_lease_file`` refuses a file of another owner: read through a copy of our own."""
    fd, copy = tempfile.mkstemp(prefix="kd-lease-", dir="/var/tmp")  # 0600, ours
    try:
        os.write(fd, path.read_bytes())
        os.close(fd)
        return read_lease_file(copy)
    finally:
        os.unlink(copy)


def _workspace(standin: GitStandin, tmp: Path, name: str = "ws") -> Path:
    ws = tmp / name
    subprocess.run(["git", "clone", "-q", str(standin.root / "example" / "repo.git"), str(ws)], check=True,
                   timeout=60)
    subprocess.run(["git", "-C", str(ws), "remote", "set-url", "origin", REMOTE], check=True, timeout=30)
    return for_agent(ws)


@pytest.fixture
def setup(kandev_factory: Any, short_tmp: Path) -> Iterator[Setup]:
    token_file = short_tmp / "github-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    upstream = short_tmp / "up"
    upstream.mkdir()
    standin = GitStandin(upstream, TOKEN)
    standin.bare_repo("example", "repo")
    standin.bare_repo("example", "other")
    try:
        ws = _workspace(standin, short_tmp)
        k = kandev_factory("home", _config(token_file, standin.url))
        k.up()
        task_id = k.cli("task", "create", "--title", "gh", "--workspace", str(ws))["task_id"]
        yield Setup(k, standin, ws, token_file, task_id, short_tmp)
    finally:
        standin.close()


def sh(k: Kandev, sid: str, command: str) -> tuple[int, str]:
    """``/sh command`` in the agent: (exit code, first 4 KiB of its output)."""
    k.cli("prompt", sid, f"/sh {command}", "--wait", timeout=180)
    said = [m["text"] for m in k.show(sid)["transcript"] if m["kind"] == "agent_message_chunk"][-1]
    head, _, out = said.partition("\n")
    match = re.fullmatch(r"sh: exit=(-?\d+)", head)
    assert match, said
    return int(match.group(1)), out


def upstream_ref(s: Setup, repo: str, ref: str) -> str | None:
    p = subprocess.run(["git", "--git-dir", str(s.standin.root / "example" / f"{repo}.git"), "rev-parse", "--verify",
                        "-q", ref], capture_output=True, text=True, timeout=30)
    return p.stdout.strip() or None


def commit_and_push(s: Setup, sid: str, refspec: str, remote: str = "origin") -> tuple[int, str]:
    return sh(s.k, sid, f"date +%s%N >> change && git add change && {GIT_ID} git commit -qm change &&"
                        f" git push {remote} {refspec} 2>&1")


def test_scenario_b_push_fetch_and_clone_go_through_the_endpoint(setup: Setup) -> None:
    """Issue 20 scenario B: the agent commits and ``git push origin HEAD:refs/heads/feature``
    succeeds; the stand-in received it with the upstream token (its request log); ``git fetch`` and
    ``git clone`` of its own repository work; a journal entry records the push."""
    s = setup
    sid = s.start()
    before = len(s.standin.log_lines())
    code, out = commit_and_push(s, sid, "HEAD:refs/heads/feature")
    assert code == 0, out
    head = sh(s.k, sid, "git rev-parse HEAD")[1].strip()
    assert upstream_ref(s, "repo", "refs/heads/feature") == head
    pushed = s.standin.log_lines()[before:]
    assert "GET /example/repo.git/info/refs auth=token status=200" in pushed
    assert "POST /example/repo.git/git-receive-pack auth=token status=200" in pushed
    assert all("auth=token" in line for line in pushed), pushed

    code, out = sh(s.k, sid, "git fetch -q origin 2>&1 && git rev-parse origin/feature")
    assert code == 0 and out.strip() == head, out
    code, out = sh(s.k, sid, f"git clone -q {REMOTE} sub-clone 2>&1; git -C sub-clone log"
                             " --format=%s -1; rm -rf sub-clone")
    assert code == 0 and out.strip().endswith("first"), out
    assert "POST /example/repo.git/git-upload-pack auth=token status=200" in s.standin.log_lines()
    log = (s.k.home / "logs" / "backend.log").read_text()
    assert "git_endpoint_push" in log and "refs/heads/feature" in log
    print("stand-in request log:", *s.standin.log_lines(), sep="\n")  # shown with -rP: the push through the endpoint


def test_scenario_a_no_upstream_token_inside_the_sandbox(setup: Setup) -> None:
    """Issue 20 scenario A: from inside the agent, ``git credential fill`` for its own repository,
    its environment, ``/proc/self/environ`` and a recursive search of every readable directory
    (all but the read-only ``/usr`` system tree and the kernel's ``/proc``, ``/sys``, ``/dev``)
    show no upstream token, while its push works. The script gets the token rot13-encoded, so
    that the prompt text (kept in the agent's own state) does not hold it either."""
    s = setup
    sid = s.start()
    assert commit_and_push(s, sid, "HEAD:refs/heads/a-works")[0] == 0
    code, out = sh(s.k, sid, "printf 'protocol=https\\nhost=github.com\\npath=example/repo.git\\n\\n' |"
                             " git credential fill 2>&1; echo rc=$?")
    assert "rc=0" not in out and "password=" not in out and TOKEN not in out, out
    encoded = codecs.encode(TOKEN, "rot13")
    script = (f"T=$(echo {encoded} | tr A-Za-z N-ZA-Mn-za-m); "
              'env | grep -c "$T"; tr "\\0" "\\n" < /proc/self/environ | grep -c "$T"; '
              # Not the host's read-only system (/usr, /opt: gigabytes kandev never writes to).
              'for d in /* /.[!.]*; do case $d in /usr|/opt|/proc|/sys|/dev) ;; *) grep -rlsF -- "$T" "$d";; esac; done;'
              ' echo searched')
    code, out = sh(s.k, sid, script)
    assert out.split() == ["0", "0", "searched"], out
    # What the agent holds instead: its own lease file (a per-session lease and capability).
    lease = SessionDirs.for_session(s.k.home, sid).lease_file
    code, out = sh(s.k, sid, f"cat {lease}")
    assert code == 0 and '"lease_token": "kgl_' in out and TOKEN not in out


def test_scenario_c_other_repositories_and_the_default_branch_are_refused(setup: Setup) -> None:
    """Issue 20 scenario C: a push or fetch to another repository on the same host (by URL, through
    another remote name, or after the agent points ``origin`` at it) is refused with a clear message
    and the stand-in never sees a request for it; a push to the default branch is refused under the
    default ``credentials.push_refs``, named in git's output and the journal, and never reaches the
    upstream."""
    s = setup
    sid = s.start()
    other = "https://github.com/example/other.git"
    code, out = commit_and_push(s, sid, "HEAD:refs/heads/feature", remote=other)
    assert code != 0 and "kandev: scope_denied" in out and "example/other" in out, out
    code, out = sh(s.k, sid, f"git remote add theirs {other} && git fetch theirs 2>&1")
    assert code != 0 and "kandev: scope_denied" in out, out
    code, out = sh(s.k, sid, f"git remote set-url origin {other} && git push origin HEAD:refs/heads/x 2>&1;"
                             f" git remote set-url origin {REMOTE}")
    assert "kandev: scope_denied" in out, out
    assert not [line for line in s.standin.log_lines() if "/example/other.git" in line]
    assert upstream_ref(s, "other", "refs/heads/feature") is None

    main_before = upstream_ref(s, "repo", "refs/heads/main")
    receive_posts = sum("git-receive-pack auth" in line for line in s.standin.log_lines())
    code, out = sh(s.k, sid, "git push origin HEAD:refs/heads/main 2>&1")
    assert code != 0 and "refs/heads/main" in out and "credentials.push_refs" in out, out
    assert "[remote rejected]" in out, out
    assert upstream_ref(s, "repo", "refs/heads/main") == main_before
    assert sum("git-receive-pack auth" in line for line in s.standin.log_lines()) == receive_posts
    log = (s.k.home / "logs" / "backend.log").read_text()
    assert "git_endpoint_refused" in log and "push_refs" in log and "scope_denied" in log


def _check_lease(home: Path, lease_file: Path) -> str:
    """The lease checked at the backend's own socket (which serves any session's lease)."""
    return valid_lease(str(lease_file), str(Paths.for_home(home).backend_socket), "github.com", "example/repo.git")


def test_scenario_d_what_the_agent_held_ends_with_its_session_and_its_task(setup: Setup) -> None:
    """Issue 20 scenario D: once the session has ended, its endpoints are gone and its lease no
    longer checks anywhere (``session_terminal``); once its task is deleted, a saved copy of the
    lease file (lease and capability) is refused too."""
    s = setup
    sid = s.start()
    dirs = SessionDirs.for_session(s.k.home, sid)
    assert commit_and_push(s, sid, "HEAD:refs/heads/d-before")[0] == 0
    token, capability = _read_lease(dirs.lease_file)
    saved = write_lease_file(s.tmp / "saved" / "lease.json", token, capability)
    assert _check_lease(s.k.home, saved) == token
    s.k.cli("prompt", sid, "/exit 2")
    wait_until(lambda: s.k.show(sid)["state"] == "FAILED", timeout=60)
    wait_until(lambda: not dirs.proxy_socket.exists() and not dirs.endpoint_socket.exists(), timeout=30)
    with pytest.raises(HelperError) as ended:
        _check_lease(s.k.home, saved)
    assert ended.value.code == "session_terminal"
    s.k.cli("task", "delete", s.task_id)
    assert not dirs.root.exists()
    with pytest.raises(HelperError) as deleted:
        _check_lease(s.k.home, saved)
    assert deleted.value.code in ("lease_invalid", "capability_invalid", "not_found"), deleted.value


def test_scenario_d_a_push_across_a_backend_sigkill_and_the_retracked_agent(setup: Setup) -> None:
    """Issue 20 scenario D and item 4: the backend is SIGKILLed (survival on); a push started with
    the agent's own git configuration while it is down waits for it and completes once it is back;
    the re-tracked agent pushes again through its session's endpoint."""
    s = setup
    sid = s.start()
    before = s.k.show(sid)
    # The agent commits, then waits (in the background, in its sandbox) on a fifo the test opens
    # once the backend is dead; then it pushes with its own git configuration, as any agent would.
    gate = s.workspace / "go.fifo"
    os.mkfifo(gate)
    for_agent(gate)
    code, out = sh(s.k, sid, f"date +%s%N >> during && git add during && {GIT_ID} git commit -qm during &&"
                             " (read x < go.fifo; git push origin HEAD:refs/heads/during-restart > push.out 2>&1;"
                             " echo $? > push.rc) </dev/null >/dev/null 2>&1 &")
    assert code == 0, out
    pid = s.k.backend_pid
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), timeout=30)
    with open(gate, "w") as g:  # blocks until the agent's reader has it open: the push starts now
        g.write("go\n")
    agent = psutil.Process(int(before["agent_pid"]))
    wait_until(lambda: any("push" in cmd for cmd in _descendant_commands(agent)), timeout=60)
    assert not (s.workspace / "push.rc").exists()  # the push waits for the backend
    s.k.up()
    rc = wait_until(lambda: (s.workspace / "push.rc").read_text().strip() or None
                    if (s.workspace / "push.rc").exists() else None, timeout=120)
    assert rc == "0", (s.workspace / "push.out").read_text()
    assert upstream_ref(s, "repo", "refs/heads/during-restart") is not None
    show = wait_until(lambda: v if (v := s.k.show(sid))["retracked"] else None, timeout=60)
    assert show["agent_pid"] == before["agent_pid"]
    code, out = commit_and_push(s, sid, "HEAD:refs/heads/after-restart")
    assert code == 0, out
    assert upstream_ref(s, "repo", "refs/heads/after-restart") is not None


def _descendant_commands(proc: psutil.Process) -> list[list[str]]:
    try:
        children = proc.children(recursive=True)
    except psutil.Error:
        return []
    return [cmdline(child.pid) for child in children]


def _ask(path: Path, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.settimeout(30)
        c.connect(str(path))
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        chunks = []
        while data := c.recv(65536):
            chunks.append(data)
        return b"".join(chunks)


def test_scenario_e_bad_input_clear_errors_and_nothing_leaked(setup: Setup) -> None:
    """Issue 20 scenario E: malformed requests to the endpoint and 100 concurrent connections get an
    ``ERR kandev: ...`` each, the backend stays up and a push still works; a missing or unreadable
    token file and an unreachable ``credentials.github_url`` fail git with a message naming the
    setting; neither the upstream token nor the lease appear in any log."""
    s = setup
    sid = s.start()
    dirs = SessionDirs.for_session(s.k.home, sid)
    for payload in (b"not json\n", b'{"v": 1}\n', b'{"v": 1, "service": "git-upload-archive", "host": "h",'
                    b' "path": "p", "lease_token": "t"}\n', b"\xff" * 70000, b""):
        answer = _ask(dirs.proxy_socket, payload)
        assert answer[4:16] == b"ERR kandev: ", answer[:200]

    answers: list[bytes] = []
    lock = threading.Lock()

    def one() -> None:
        a = _ask(dirs.proxy_socket, b"garbage\n")
        with lock:
            answers.append(a)

    threads = [threading.Thread(target=one) for _ in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(answers) == 100 and all(a[4:16] == b"ERR kandev: " for a in answers), answers[:3]
    assert s.k.status()["backend"]["pid"]
    assert commit_and_push(s, sid, "HEAD:refs/heads/e-still-works")[0] == 0

    moved = s.token_file.with_name("moved")
    s.token_file.rename(moved)
    code, out = commit_and_push(s, sid, "HEAD:refs/heads/e-missing")
    assert code != 0 and "credentials.github_token_file" in out, out
    moved.rename(s.token_file)
    s.token_file.chmod(0o644)
    code, out = sh(s.k, sid, "git push origin HEAD:refs/heads/e-unreadable 2>&1")
    assert code != 0 and "credentials.github_token_file" in out, out
    s.token_file.chmod(0o600)
    s.standin.close()
    code, out = sh(s.k, sid, "git push origin HEAD:refs/heads/e-unreachable 2>&1")
    assert code != 0 and "cannot reach credentials.github_url" in out, out
    assert s.k.status()["backend"]["pid"]

    token, capability = _read_lease(dirs.lease_file)
    logs = [p for p in (s.k.home / "logs").rglob("*") if p.is_file()]
    assert logs
    for p in logs:
        text = p.read_text(errors="replace")
        for secret in (TOKEN, token, capability):
            assert secret not in text, p


def test_scenario_e_no_token_configured_names_the_setting(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 20 scenario E and item 4: with no ``credentials.github_token_file`` a GitHub-backed
    session still starts; its git push fails at once with a message naming the setting, and the
    stand-in is never asked (git does not go to the host anonymously)."""
    upstream = short_tmp / "up"
    upstream.mkdir()
    standin = GitStandin(upstream, TOKEN)
    try:
        standin.bare_repo("example", "repo")
        ws = _workspace(standin, short_tmp)
        k = kandev_factory("home", f'[credentials]\ngithub_url = "{standin.url}"\n')
        k.up()
        task_id = k.cli("task", "create", "--title", "gh", "--workspace", str(ws))["task_id"]
        sid = k.cli("session", "start", task_id)["session_id"]
        code, out = sh(k, sid, "git push origin HEAD:refs/heads/feature 2>&1")
        assert code != 0 and "credentials.github_token_file is not set" in out, out
        assert standin.log_lines() == []
    finally:
        standin.close()
