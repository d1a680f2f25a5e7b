"""Resume through real daemons (Issue 5 scenario A, Issue 5 scenario B and Issue 5 scenario D; RESUME-1, RESUME-2, RESUME-3, RESUME-4, RESUME-5, RESUME-6, RESUME-7, RESUME-8, RESUME-9, RESUME-10), the real mock agent.

A: the agent exits before answering ``initialize`` (or drops the transport before ``session/load``
   completes, or refuses the load): the token is unchanged and the session recoverable; the next
   healthy resume loads that same provider session and the conversation continues.
B: ``--fresh`` wipes the token and the new provider session's id replaces it.
D: a failure after the early STARTING (request assembly, credential issue, launch) puts the session
   back in its recoverable state, never STARTING; a GitHub-backed FAILED session gets its lease
   because STARTING is persisted first.
Guards: refused with ``session_guarded`` while recovery decides the session.
RESUME-10: after a restart and automatic resume, the transcript is there and the task is in
   ``turn_finished``, never ``backlog`` or ``running``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev, db_row, mock_state_file
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.sessions import (
    agent_log,
    identities,
    metadata,
    new_task,
    refused,
    restart,
    start,
    switches,
)
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until
from tests.support.workspaces import for_agent

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------- helpers


def db_write(k: Kandev, sql: str, *params: Any) -> None:
    con = sqlite3.connect(str(k.home / "kandev.db"))
    try:
        con.execute(sql, params)
        con.commit()
    finally:
        con.close()


def all_agent_logs(k: Kandev) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((k.home / "logs" / "agents").glob("*.stderr.log")))


def failed_session(k: Kandev, title: str) -> tuple[str, str, Path, str]:
    """A session with one finished turn whose agent then died: FAILED, recoverable."""
    task, ws = new_task(k, title)
    sid = start(k, task)
    assert k.cli("prompt", sid, "hello", "--wait")["stop_reason"] == "end_turn"
    k.cli("prompt", sid, "/exit 5")
    show = wait_until(lambda: s if (s := k.show(sid))["state"] == "FAILED" else None, timeout=30)
    assert show["recoverable"] and show["resume_token"]
    return task, sid, ws, show["resume_token"]


def up_in_background(k: Kandev) -> tuple[subprocess.Popen[str], int]:
    """``kandev up`` left running while the test watches the backend start; returns it and the
    offset in backend.log where this backend's lines begin. (``kandev up`` detaches the backend,
    so it is never a zombie child of the test that ``kandev down`` would wait for.)"""
    log = k.home / "logs" / "backend.log"
    offset = log.stat().st_size if log.exists() else 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "--home", str(k.home), "--json", "up"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=k.env, cwd=REPO_ROOT,
    )
    return proc, offset


def settle_up(k: Kandev, proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    k.backend_pids.add(int(json.loads(out)["status"]["backend"]["pid"]))


# ---------------------------------------------------------------- Issue 5 scenario A


@pytest.mark.parametrize(
    "switch, failure",
    [
        ("fail_initialize = true\n", "before answering initialize"),  # RESUME-T1
        ("exit_on_load = true\n", "transport drops before session/load completes"),  # RESUME-T2
        ("fail_load = true\n", "the agent refuses session/load"),
    ],
)
def test_scenario_a_failed_start_keeps_token_then_same_session_loads(kandev_factory, switch, failure):
    """RESUME-1, RESUME-3, RESUME-4, RESUME-7, RESUME-T1, RESUME-T2: a launch that fails before a
    provider session exists blanks neither identity; the next healthy resume calls session/load with
    that same id and the conversation continues (never a silent fresh start)."""
    k = kandev_factory()
    k.up()
    task, sid, ws, token = failed_session(k, "a")
    assert identities(k, sid) == (token, token)
    switches(ws, switch)
    error = refused(k, "resume", sid)
    assert error["code"] == "agent_error", (failure, error)
    assert "keeps its resume token" in error["message"]
    show = k.show(sid)
    assert show["state"] == "FAILED" and not show["live"], failure  # back to the prior state (RESUME-7)
    assert identities(k, sid) == (token, token), failure
    assert task in k.cli("board")["needs_attention"]
    assert "session/new" not in all_agent_logs(k).split("/exit")[-1]  # no fresh conversation was opened

    switches(ws, None)
    resumed = k.cli("resume", sid)
    assert resumed["state"] == "WAITING_FOR_INPUT" and resumed["loaded"] is True
    assert resumed["acp_session_id"] == token and resumed["resume_token"] == token
    assert identities(k, sid) == (token, token)
    show = k.show(sid)
    assert show["live"] and show["instance_id"] == resumed["instance_id"]
    assert f"session/load cwd={ws} session={token}" in agent_log(k, resumed["instance_id"])
    assert task in k.cli("board")["turn_finished"]
    # the transcript continues: the replayed history is not stored twice, the new turn follows
    assert k.cli("prompt", sid, "again", "--wait")["stop_reason"] == "end_turn"
    assert agent_chunks(k.show(sid)) == ["echo: hello", "exiting 5", "echo: again"]
    history = mock_state_file(k, f"{token}.history.jsonl")
    texts = [json.loads(line)["text"] for line in history.read_text().splitlines()]
    assert texts == ["hello", "echo: hello", "/exit 5", "exiting 5", "again", "echo: again"]


def test_resume_refusals(kandev_factory):
    """RESUME-2 (no silent fresh start); a live agent is refused; unknown session not_found."""
    k = kandev_factory()
    k.up()
    task, ws = new_task(k, "refusals")
    sid = start(k, task)
    assert refused(k, "resume", sid)["code"] == "conflict"  # a live agent
    assert refused(k, "resume", "no-such-session")["code"] == "not_found"
    k.cli("prompt", sid, "/exit 1")
    wait_until(lambda: k.show(sid)["state"] == "FAILED", timeout=30)
    db_write(k, "UPDATE executors_running SET resume_token = NULL WHERE session_id = ?", sid)
    db_write(k, "UPDATE task_sessions SET metadata_json = json_set(metadata_json, '$.acp.session_id', NULL)"
             " WHERE id = ?", sid)
    error = refused(k, "resume", sid)
    assert error["code"] == "conflict" and "--fresh" in error["message"]
    assert k.show(sid)["state"] == "FAILED"


# ---------------------------------------------------------------- Issue 5 scenario B


def test_scenario_b_fresh_replaces_the_token(kandev_factory):
    """RESUME-2, RESUME-3: --fresh wipes the token; the new provider session's id replaces both
    identities once the agent created it. The stored transcript is kept."""
    k = kandev_factory(KANDEV_FEATURES_AUTO_RESUME="false")  # resumed by hand, not automatically
    k.up()
    task, ws = new_task(k, "b")
    sid = start(k, task)
    k.cli("prompt", sid, "before", "--wait")
    old = k.show(sid)["resume_token"]
    restart(k)  # survival off: the agent dies with the backend; the session waits, interrupted
    show = k.show(sid)
    assert show["state"] == "WAITING_FOR_INPUT" and not show["live"] and identities(k, sid) == (old, old)
    fresh = k.cli("resume", sid, "--fresh")
    new = fresh["acp_session_id"]
    assert fresh["fresh"] is True and fresh["loaded"] is False and new and new != old
    assert identities(k, sid) == (new, new)
    log = agent_log(k, fresh["instance_id"])
    assert "session/new" in log and "session/load" not in log
    k.cli("prompt", sid, "after", "--wait")
    assert agent_chunks(k.show(sid)) == ["echo: before", "echo: after"]
    history = mock_state_file(k, f"{new}.history.jsonl")
    assert [json.loads(line)["text"] for line in history.read_text().splitlines()] == ["after", "echo: after"]


def test_fresh_start_failure_keeps_the_wipe(kandev_factory):
    """RESUME-2: Start fresh wipes the token even if its launch then fails; nothing replaces it."""
    k = kandev_factory()
    k.up()
    task, sid, ws, token = failed_session(k, "fresh-fail")
    switches(ws, "fail_initialize = true\n")
    assert refused(k, "resume", sid, "--fresh")["code"] == "agent_error"
    assert identities(k, sid) == (None, None)
    assert k.show(sid)["state"] == "FAILED"


# ---------------------------------------------------------------- Issue 5 scenario D


def _github_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=30)
    subprocess.run(["git", "remote", "add", "origin", "https://github.com/example/repo.git"], cwd=repo,
                   check=True, timeout=30)
    return for_agent(repo)


@pytest.mark.parametrize("stage", ["request", "credential", "launch"])
def test_scenario_d_failure_after_starting_restores_prior_state(kandev_factory, short_tmp, stage):
    """RESUME-5, RESUME-7, RESUME-8, RESUME-9, RESUME-T5: request assembly, credential issue and
    launch fail one at a time after the early STARTING: the session is back in its recoverable
    state (FAILED, or WAITING_FOR_INPUT), not STARTING, with both identities kept."""
    token_file = short_tmp / "github-token"
    token_file.write_text("ghp_resumeTESTupstream0123456789abcdefgh\n")
    token_file.chmod(0o600)
    k = kandev_factory("home", f'[credentials]\ngithub_token_file = "{token_file}"\n',
                       KANDEV_FEATURES_AUTO_RESUME="false")  # the restart's session is resumed by hand
    k.up()
    repo = _github_repo(short_tmp)
    task, ws = new_task(k, "d", "--workspace", str(repo))
    sid = start(k, task)
    k.cli("prompt", sid, "hello", "--wait")
    token = k.show(sid)["resume_token"]
    if stage == "launch":
        restart(k)  # the prior state is WAITING_FOR_INPUT without an agent
        prior = "WAITING_FOR_INPUT"
        switches(ws, "fail_load = true\n")
    else:
        k.cli("prompt", sid, "/exit 2")
        wait_until(lambda: k.show(sid)["state"] == "FAILED", timeout=30)
        prior = "FAILED"
        if stage == "request":
            db_write(k, "UPDATE task_sessions SET agent = 'no-such-agent' WHERE id = ?", sid)
        else:
            token_file.chmod(0o644)  # the broker refuses a token file others may read
    error = refused(k, "resume", sid)
    assert error["code"] in {"request": "invalid_argument", "credential": "credentials_unavailable",
                             "launch": "agent_error"}[stage], error
    show = k.show(sid)
    assert show["state"] == prior and show["state"] != "STARTING" and not show["live"]
    assert identities(k, sid) == (token, token)
    assert metadata(k, sid)["resume"]["status"] == "failed"
    log = (k.home / "logs" / "backend.log").read_text()
    # STARTING came first, then the prior state again, both through the guarded transition (RESUME-8)
    assert re.search(rf"session {sid} {prior} -> STARTING \(resume\).*\n(.*\n)*?.*session {sid} STARTING -> {prior}"
                     r" \(resume failed", log)

    # the cause removed: the lease is issued now that STARTING comes first, and the launch proceeds
    if stage == "request":
        db_write(k, "UPDATE task_sessions SET agent = 'mock' WHERE id = ?", sid)
    token_file.chmod(0o600)
    switches(ws, None)
    resumed = k.cli("resume", sid)
    assert resumed["state"] == "WAITING_FOR_INPUT" and resumed["acp_session_id"] == token
    assert resumed["credential_policy"] == "github-lease"
    snapshot = metadata(k, sid)["git_credential_snapshot"]  # RESUME-6: stored, non-secret, this attempt's
    assert snapshot["policy"] == "github-lease" and snapshot["repository"] == "example/repo"
    assert "ghp_" not in json.dumps(snapshot)
    lease = db_row(k, "SELECT * FROM credential_leases WHERE id = ?", snapshot["lease_id"])
    assert lease is not None and not lease["revoked"]


# ---------------------------------------------------------------- guards


def test_resume_refused_while_recovery_guards_the_session(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-002.8 for resume: refused with session_guarded (retryable) while recovery
    decides the session (here an adoption still in flight, so the window is seconds long); once
    recovery stopped the survivor and repaired the row, the same resume loads the same session."""
    deadline = {"KANDEV_AGENTCTL_RECOVERY_DEADLINE": "5s", "KANDEV_AGENTCTL_RECOVERY_READ_TIMEOUT": "500ms",
                "KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "1"}
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FAULT="agentctl_slow_rotate:8",
                       KANDEV_FEATURES_AUTO_RESUME="false", **deadline)  # resumed by hand
    st = k.up()
    task, ws = new_task(k, "guarded")
    sid = start(k, task)
    k.cli("prompt", sid, "hello", "--wait")
    token = k.show(sid)["resume_token"]
    backend = st["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    proc, _ = up_in_background(k)
    wait_until(lambda: (r := k.run("status")).returncode == 0
               and json.loads(r.stdout)["backend"]["state"] == "recovering", timeout=30)
    error = refused(k, "resume", sid)
    assert error["code"] == "session_guarded" and error["retryable"] is True, error
    assert json.loads(k.run("status").stdout)["backend"]["state"] == "recovering"  # refused *while* recovering
    settle_up(k, proc)
    wait_until(lambda: (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" and not s["live"] and not s["guard"],
               timeout=60)
    resumed = k.cli("resume", sid)
    assert resumed["acp_session_id"] == token and resumed["loaded"] is True


# ---------------------------------------------------------------- RESUME-10


def test_turn_finished_after_restart_and_automatic_resume(kandev_factory):
    """RESUME-10, RESUME-T6: a finished turn whose response is stored while the session lifecycle has
    not settled (still RUNNING, task in progress) when the backend dies: after the restart and the
    automatic resume the transcript is visible and the task is in turn_finished, never in backlog
    or running, and the session is back at WAITING_FOR_INPUT with the same provider session."""
    k = kandev_factory(KANDEV_FEATURES_AUTO_RESUME="true")
    st = k.up()
    task, ws = new_task(k, "review")
    sid = start(k, task)
    k.cli("prompt", sid, "hello", "--wait")
    token = k.show(sid)["resume_token"]
    backend = st["backend"]["pid"]
    os.kill(backend, signal.SIGKILL)  # survival off: the control server and the agent die with it
    wait_until(lambda: not alive(backend), timeout=10)
    # the response is stored; the lifecycle had not caught up yet
    db_write(k, "UPDATE task_sessions SET state = 'RUNNING' WHERE id = ?", sid)
    db_write(k, "UPDATE tasks SET state = 'in_progress' WHERE id = ?", task)

    proc, offset = up_in_background(k)
    # From readiness on (startup recovery and reconciliation done; before that the store still
    # says what it said when the old backend died), sampled as fast as the CLI answers.
    settle_up(k, proc)
    seen: list[str] = []

    def settled() -> dict[str, Any] | None:
        r = k.run("board")
        if r.returncode == 0:
            board = json.loads(r.stdout)
            seen.extend(bucket for bucket, tasks in board.items() if task in tasks)
            show = k.show(sid)
            if show["live"] and show["state"] == "WAITING_FOR_INPUT":
                return show
        return None

    show = wait_until(settled, timeout=90, interval=0.02)
    assert seen and set(seen) == {"turn_finished"}, seen
    assert task in k.cli("board")["turn_finished"]
    assert agent_chunks(show) == ["echo: hello"]
    assert show["resume_token"] == token and identities(k, sid) == (token, token)
    assert f"session={token}" in agent_log(k, show["instance_id"])  # session/load of the same session
    log = (k.home / "logs" / "backend.log").read_text()[offset:]
    states = re.findall(rf"session {sid} (\w+) -> (\w+) \(([^)]*)", log)
    assert [(a, b) for a, b, _ in states] == [("RUNNING", "WAITING_FOR_INPUT"), ("WAITING_FOR_INPUT", "STARTING"),
                                              ("STARTING", "WAITING_FOR_INPUT")], states
    assert states[1][2] == "automatic resume"


def test_automatic_resume_leaves_retracked_sessions_alone(kandev_factory):
    """RESUME-10 with survival on: a re-tracked session gets no provider resume (AC-EXECUTORS-SURVIVAL-001.4)."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FEATURES_AUTO_RESUME="true")
    k.up()
    task, ws = new_task(k, "survived")
    sid = start(k, task)
    k.cli("prompt", sid, "hello", "--wait")
    before = k.show(sid)
    restart(k)
    after = wait_until(lambda: s if (s := k.show(sid))["retracked"] else None, timeout=30)
    assert after["instance_id"] == before["instance_id"] and after["agent_pid"] == before["agent_pid"]
    assert "session/load" not in all_agent_logs(k)
    assert "session_resumed" not in [m["kind"] for m in after["transcript"]]
    assert task in k.cli("board")["turn_finished"]


def test_history_replayed_after_the_load_answer_never_reaches_the_transcript(kandev_factory):
    """Issue 22 item 3: an agent that replays a loaded session's history *after* answering
    session/load (as Gemini CLI does; the mock's ``replay_after_load``, one update every 50 ms):
    the resume's handshake lasts until the replay is over, so none of it is stored, and the next
    turn holds only its own output."""
    k = kandev_factory()
    k.up()
    _task, sid, ws, token = failed_session(k, "replay after load")
    switches(ws, "replay_after_load = true\n")
    resumed = k.cli("resume", sid)
    assert resumed["loaded"] is True and resumed["acp_session_id"] == token
    assert k.cli("prompt", sid, "again", "--wait")["stop_reason"] == "end_turn"
    show = k.show(sid)
    assert agent_chunks(show) == ["echo: hello", "exiting 5", "echo: again"]
    assert [m["text"] for m in show["transcript"] if m["role"] == "user"] == ["hello", "/exit 5", "again"]
    assert [m["text"] for m in show["transcript"] if m.get("turn_id") == show["turns"][-1]["turn_id"]
            and m["kind"] == "agent_message_chunk"] == ["echo: again"]
