"""The ``kandev`` CLI contract (README.md#using-it) against a real backend: results, exit codes, --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(180)


def test_commands_and_json_results(kandev_factory):
    k = kandev_factory()
    st = k.up()
    assert set(st) >= {"backend", "capability", "control_server", "recovery", "adoption"}
    assert st["backend"]["state"] == "ready" and st["backend"]["version"]
    assert (st["capability"]["state"], st["capability"]["reason"]) == ("disabled", "operator_disabled")
    again = k.cli("up")
    assert again["started"] is False and again["pid"] == st["backend"]["pid"]

    task = k.cli("task", "create", "--title", "cli")["task_id"]
    assert task in k.cli("board")["backlog"]
    started = k.cli("session", "start", task, "--prompt", "hello there")
    sid = started["session_id"]
    assert started["turn_id"]
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=30)
    assert agent_chunks(done) == ["echo: hello there"]

    waited = k.cli("prompt", sid, "second", "--wait")
    assert waited["stop_reason"] == "end_turn" and waited["turn_id"].endswith(":2")
    show = k.show(sid)
    assert set(show) >= {
        "state", "task_id", "agent_pid", "instance_id", "resume_token", "retracked", "runtime_config",
        "turns", "transcript",
    }
    assert [t["stop_reason"] for t in show["turns"]] == ["end_turn", "end_turn"]
    assert show["runtime_config"].keys() >= {"model", "mode", "options"}
    listed = k.cli("session", "list")["sessions"]
    assert [(s["session_id"], s["task_id"], s["state"], s["retracked"]) for s in listed] == [
        (sid, task, "WAITING_FOR_INPUT", False)
    ]
    assert task in k.cli("board")["turn_finished"]


def test_cancel_ends_the_turn_cancelled(kandev_factory):
    k = kandev_factory()
    k.up()
    task, sid = k.start_session("cancel")
    k.cli("prompt", sid, "/slow 60")
    wait_until(lambda: len(agent_chunks(k.show(sid))) >= 1, timeout=30)
    assert task in k.cli("board")["running"]
    assert k.cli("cancel", sid) == {"ok": True}
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "WAITING_FOR_INPUT" else None, timeout=30)
    assert done["turns"][-1]["stop_reason"] == "cancelled"
    assert len(agent_chunks(done)) < 60


def test_exit_codes_and_typed_errors(kandev_factory):
    k = kandev_factory()
    unreachable = k.run("status")
    assert unreachable.returncode == 3
    assert json.loads(unreachable.stdout)["error"]["code"] == "unavailable"
    usage = k.run("session", "frobnicate")
    assert usage.returncode == 2
    k.up()
    missing = k.run("session", "show", "no-such-session")
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]["code"] == "not_found"
    assert "not_found" in missing.stderr
    task = k.cli("task", "create", "--title", "x")["task_id"]
    bad_agent = k.run("session", "start", task, "--agent", "nope")
    assert bad_agent.returncode == 1
    assert json.loads(bad_agent.stdout)["error"]["code"] == "invalid_argument"
    _, sid = k.start_session("busy")
    k.cli("prompt", sid, "/slow 30")
    busy = k.run("prompt", sid, "again")
    assert busy.returncode == 1 and json.loads(busy.stdout)["error"]["code"] == "conflict"


def test_agent_exit_fails_the_session(kandev_factory):
    k = kandev_factory()
    k.up()
    task, sid = k.start_session("exit")
    k.cli("prompt", sid, "/exit 7")
    done = wait_until(lambda: s if (s := k.show(sid))["state"] == "FAILED" else None, timeout=30)
    assert "code 7" in (done["last_error"] or "")
    assert done["recoverable"] and done["resume_token"]
    assert task in k.cli("board")["needs_attention"]


def test_second_backend_on_the_same_home_is_refused(kandev_factory):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.4 (docs/architecture.md#ownership single driver): a second backend exits naming the holder."""
    k = kandev_factory()
    st = k.up()
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
        capture_output=True, text=True, env=k.env, timeout=60, cwd=REPO_ROOT,
    )
    assert proc.returncode == 1
    assert f"pid {st['backend']['pid']}" in proc.stderr
    assert k.status()["backend"]["pid"] == st["backend"]["pid"]


def test_second_backend_on_the_same_external_sqlite_file_is_refused(kandev_factory, short_tmp):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.4: "and on an external SQLite file if one is used": two
    homes whose database.url names one SQLite file; the second backend exits naming the holder,
    before it logs or opens the store."""
    shared = short_tmp / "shared.db"
    config = f'[database]\nurl = "sqlite:///{shared}"\n'
    first = kandev_factory("one", config)
    st = first.up()
    second = kandev_factory("two", config)
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(second.home)],
        capture_output=True, text=True, env=second.env, timeout=60, cwd=REPO_ROOT,
    )
    assert proc.returncode == 1, proc.stderr
    assert f"pid {st['backend']['pid']}" in proc.stderr and f"{shared}.lock is locked" in proc.stderr
    assert not (second.home / "logs" / "backend.log").exists()
    assert first.status()["backend"]["pid"] == st["backend"]["pid"]
    first.cli("down")
    # The lock ends with its holder, but the store remembers the installation that created it
    # (Issue 10 item 5): another installation is still refused, naming both ids.
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(second.home)],
        capture_output=True, text=True, env=second.env, timeout=60, cwd=REPO_ROOT,
    )
    assert proc.returncode == 1 and "belongs to installation" in proc.stderr, proc.stderr
    assert first.up()["backend"]["state"] == "ready"


def test_a_start_whose_agent_fails_to_start_is_failed_not_starting(kandev_factory):
    """An agent that exits before answering initialize: `session start` says agent_error, and the
    session is FAILED with the launch's reason (never left STARTING)."""
    k = kandev_factory()
    k.up()
    out = k.cli("task", "create", "--title", "broken agent")
    (Path(out["workspace"]) / ".kandev-mock.toml").write_text("fail_initialize = true\n")
    proc = k.run("session", "start", out["task_id"])
    assert proc.returncode == 1
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "agent_error" and "agent failed to start" in error["message"], error
    (session,) = k.cli("session", "list")["sessions"]
    show = k.show(session["session_id"])
    assert show["state"] == "FAILED" and show["last_error"].startswith("launch: "), show["last_error"]
