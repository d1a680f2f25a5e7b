"""Issue 46 Why 2 (Issue 46 item 2): survival is one documented switch, and a restart that
interrupted a session gives it its agent back by itself.

Real daemons through the real CLI (stdout, stderr, exit status). Before Issue 46: `kandev up` had
no `--survival`; `kandev down` during a turn said only "its 1 agent was stopped"; the follow, the
transcript and the board said `interrupted` with no word of why; `features.auto_resume` was off, so
after a restart every interrupted session waited under NEEDS ATTENTION (`no agent`) for a
`kandev resume` by hand.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.support.kandev import Kandev
from tests.support.paths import REPO_ROOT
from tests.support.processes import alive
from tests.support.streams import TimedOutput
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

WHY = "interrupted: the backend stopped and survival is off"


def _session(k: Kandev, title: str) -> tuple[str, str]:
    task, sid = k.start_session(title)
    return task, sid


def _resumed(k: Kandev, sid: str, old_pid: int) -> dict | None:
    show = k.show(sid)
    if show["state"] == "WAITING_FOR_INPUT" and show["live"] and show["agent_pid"] != old_pid:
        return show
    return None


def test_down_says_which_turns_it_ends_and_the_restart_resumes_the_interrupted_session(kandev_factory) -> None:
    """Issue 46 Why 2 (Issue 46 item 2, acceptance A): with the defaults (survival off, automatic
    resume on), `kandev down` during a turn says it ends 1 running turn and how to keep it next
    time; the follow, the transcript and the board say why the turn was interrupted; after
    `kandev up` the interrupted session is WAITING_FOR_INPUT with a new, resumed agent and its
    task in TURN FINISHED, while a session whose agent had been stopped before is not relaunched."""
    k = kandev_factory("defaults")
    assert k.up()["capability"]["state"] == "disabled"
    task, sid = _session(k, "busy")
    idle_task, idle = _session(k, "idle")
    assert k.human("session", "stop", idle).returncode == 0  # no live agent before the restart
    old_pid = int(k.show(sid)["agent_pid"])

    follow = k.popen("prompt", sid, "/slow 120", "--follow")
    out = TimedOutput(follow.stdout)
    out.wait_for("2/120", timeout=60)
    down = k.human("down")
    assert down.returncode == 0, down.stderr
    assert "its 1 agent was stopped, ending 1 running turn." in down.stdout, down.stdout
    assert "kandev up --survival" in down.stdout and "features.agent_survival = true" in down.stdout, down.stdout
    wait_until(lambda: not alive(old_pid), timeout=30)

    k.up()
    out.wait_for(f"[turn failed: {WHY}]", timeout=90)  # the follow reconnected and says why
    assert follow.wait(timeout=30) == 1

    show = wait_until(lambda: _resumed(k, sid, old_pid), timeout=60,
                      message="the interrupted session was not resumed by itself")
    resumed = [json.loads(e["text"]) for e in show["transcript"] if e.get("kind") == "session_resumed"]
    assert resumed and resumed[-1]["automatic"] is True and resumed[-1]["loaded"] is True, resumed
    assert "1 session had its agent stopped with the previous backend (kandev down): nothing to re-track;" \
        " each has an agent again" in k.human("status").stdout
    board = wait_until(lambda: b if task in (b := k.cli("board"))["turn_finished"] else None, timeout=30)
    assert idle_task in board["needs_attention"]  # the idle session: no agent, as before the restart
    assert not k.show(idle)["live"]

    human_board = k.human("board").stdout
    row = next(line for line in human_board.splitlines() if task[:8] in line)
    assert WHY in row, human_board
    assert f"[turn failed: {WHY}]" in k.human("session", "show", sid).stdout
    assert k.show(sid)["turns"][-1]["error"] == "the backend stopped and survival is off"


def test_survival_is_one_switch_of_up_shown_by_status(kandev_factory) -> None:
    """Issue 46 Why 2 (Issue 46 item 2, acceptance A): `kandev status` names the switch while
    survival is off; `kandev up --survival` switches it on (status says enabled, `down` keeps
    the running turn); `up --survival` against a backend running without it says so."""
    k = kandev_factory("switch")
    k.up()
    status = k.human("status").stdout
    assert re.search(r"Survival: disabled", status) and "kandev up --survival" in status, status
    assert "Automatic resume is on" in status, status
    refused = k.human("up", "--survival")
    assert refused.returncode == 1 and "with agent survival off; --survival was not applied" in refused.stderr, (
        refused.stdout, refused.stderr)
    assert k.human("down").returncode == 0

    up = k.cli("up", "--survival", timeout=450)
    st = up["status"]
    k.backend_pids.add(int(st["backend"]["pid"]))
    k.server_pids.add(int(st["control_server"]["pid"]))
    assert st["capability"]["state"] == "enabled", st["capability"]
    assert "Survival: enabled" in k.human("status").stdout
    _, sid = _session(k, "kept")
    k.cli("prompt", sid, "/slow 60")
    pid = int(k.show(sid)["agent_pid"])
    down = k.human("down")
    assert down.returncode == 0 and "keeps running" in down.stdout and "--survival" not in down.stdout, down.stdout
    assert alive(pid)  # the agent and its turn outlived the backend
    stopped = k.human("down", "--agents")
    assert stopped.returncode == 0, stopped.stderr
    wait_until(lambda: not alive(pid), timeout=30)


def test_the_readmes_first_session_switches_survival_on() -> None:
    """Issue 46 Why 2 (Issue 46 item 2): the README's first session starts the backend with
    `kandev up --survival` and names the configuration key that does the same."""
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    start = lines.index("## First session")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    section = "\n".join(lines[start:end])
    assert re.search(r"^    kandev up --survival\b", section, re.MULTILINE), section
    assert "agent_survival = true" in " ".join(section.split()), section  # the key, however the text wraps
