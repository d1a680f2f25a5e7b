"""Runtime configuration across a context reset, through real daemons and the real mock agent
(Issue 5 scenario F; RESETCFG-1, RESETCFG-2, RESETCFG-3, RESETCFG-4, RESETCFG-5, RESETCFG-6, RESETCFG-7, RESETCFG-8, RESETCFG-9, RESETCFG-10, RESETCFG-11, RESETCFG-12, RESETCFG-13).

The mock agent logs every ACP request it gets (one line each, in order) to its stderr file, so the
exact payloads and order of ``session/set_config_option`` and ``session/set_mode`` are read there.
A ``session/new`` on a process that already has a session announces the new session's defaults
before it answers, and the backend stores every such event as it arrives: the race
RESETCFG-1 and RESETCFG-5 guard against.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.support.kandev import Kandev, mock_state_file
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

pytestmark = pytest.mark.timeout(300)

CHOSEN = {"model": "mock-smart", "mode": "plan", "options": {"effort": "high"}}
DEFAULTS = {"model": "mock-fast", "mode": "default", "options": {"effort": "medium"}}


def configure(k: Kandev, sid: str) -> None:
    out = k.cli("session", "configure", sid, "--model", "mock-smart", "--mode", "plan", "--option", "effort=high")
    assert out["runtime_config"] == CHOSEN
    assert out["calls"] == [["set_config_option", "model", "mock-smart"], ["set_mode", "mode", "plan"],
                            ["set_config_option", "effort", "high"]]


def config_calls(log: str, acp_session: str) -> list[str]:
    """The runtime-configuration requests the mock got for one provider session, in order."""
    out = []
    for m in re.finditer(r"session/(set_mode|set_config_option) session=(\w+) (.*)", log):
        if m.group(2) == acp_session:
            out.append(f"{m.group(1)} {m.group(3).strip()}")
    return out


def provider_state(k: Kandev, acp_session: str) -> dict[str, Any]:
    """What the mock agent itself holds for a provider session (its persisted state file)."""
    state = json.loads(mock_state_file(k, f"{acp_session}.json").read_text())
    return {"model": state["config"]["model"], "mode": state["mode"],
            "options": {k_: v for k_, v in state["config"].items() if k_ != "model"}}


def kinds_after(show: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """Transcript entries after the last one of ``kind``."""
    transcript = show["transcript"]
    idx = max(i for i, m in enumerate(transcript) if m["kind"] == kind)
    return transcript[idx + 1:]


def test_scenario_f_reset_keeps_model_mode_option_and_survives_restarts(kandev_factory):
    """RESETCFG-1, RESETCFG-2, RESETCFG-3, RESETCFG-5, RESETCFG-6, RESETCFG-7, RESETCFG-8, RESETCFG-10,
    RESETCFG-12, RESETCFG-T1, RESETCFG-T5; RESUME-2: on the ACP fast path the new session announces its
    defaults and they are stored before restore runs; restore applies the captured value with exact
    payloads in the order model, mode, options by id, to the new ACP session; the values hold after
    the reset turn, a backend restart with survival on (re-tracked), and a restart with survival off
    followed by a resume."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    k.up()
    task, ws = new_task(k, "f")
    sid = start(k, task)
    k.cli("prompt", sid, "before", "--wait")
    configure(k, sid)
    before = k.show(sid)
    old_acp = before["resume_token"]
    assert before["runtime_config"] == CHOSEN

    reset = k.cli("session", "reset-context", sid)
    new_acp = reset["acp_session_id"]
    assert reset["path"] == "acp" and new_acp != old_acp
    assert reset["captured"] == CHOSEN and reset["runtime_config"] == CHOSEN
    assert identities(k, sid) == (new_acp, new_acp)  # replaced by the new provider session (RESUME-2)
    show = k.show(sid)
    assert show["instance_id"] == before["instance_id"] and show["agent_pid"] == before["agent_pid"]
    assert show["state"] == "WAITING_FOR_INPUT" and show["runtime_config"] == CHOSEN
    # the exact payloads and their order, on the new session only
    assert config_calls(agent_log(k, show["instance_id"]), new_acp) == [
        "set_config_option model=mock-smart", "set_mode mode=plan", "set_config_option effort=high"]
    assert provider_state(k, new_acp) == CHOSEN
    # the race happened: the new session's announced default was stored before the restore's mode
    modes = [json.loads(m["text"])["currentModeId"] for m in kinds_after(show, "agent_message_chunk")
             if m["kind"] == "current_mode_update"]
    assert modes[-2:] == ["default", "plan"], modes
    kinds = [m["kind"] for m in show["transcript"]]
    assert kinds[-1] == "context_reset"
    status = metadata(k, sid)["context_reset"]
    assert status["status"] == "succeeded" and status["path"] == "acp"

    # the reset turn: a new conversation, same configuration
    k.cli("prompt", sid, "after reset", "--wait")
    assert agent_chunks(k.show(sid))[-1] == "echo: after reset"
    assert k.show(sid)["runtime_config"] == CHOSEN and provider_state(k, new_acp) == CHOSEN

    # backend restart, survival on: re-tracked, nothing re-applied, nothing lost
    restart(k)
    show = wait_until(lambda: s if (s := k.show(sid))["retracked"] else None, timeout=30)
    assert show["runtime_config"] == CHOSEN and provider_state(k, new_acp) == CHOSEN

    # a reset after the restart captures from the store (no live cache in this backend yet)
    again = k.cli("session", "reset-context", sid)
    assert again["captured"] == CHOSEN and again["runtime_config"] == CHOSEN
    newest = again["acp_session_id"]
    assert provider_state(k, newest) == CHOSEN

    # backend restart, survival off: the agent is gone; resume loads the provider session
    restart(k, KANDEV_FEATURES_AGENT_SURVIVAL="false", KANDEV_FEATURES_AUTO_RESUME="false")  # resumed by hand
    show = k.show(sid)
    assert not show["live"] and show["state"] == "WAITING_FOR_INPUT"
    resumed = k.cli("resume", sid)
    assert resumed["acp_session_id"] == newest and resumed["runtime_config"] == CHOSEN
    assert k.show(sid)["runtime_config"] == CHOSEN and provider_state(k, newest) == CHOSEN
    assert task in k.cli("board")["turn_finished"]


def test_reset_by_process_restart_restores_the_same_fields(kandev_factory):
    """RESETCFG-5, RESETCFG-6, RESETCFG-10, RESETCFG-T2: the process-restart fallback captures first,
    starts a new process with a new provider session, and restores model, mode and option to it,
    in order; the session is announced ready only after."""
    k = kandev_factory()
    k.up()
    task, ws = new_task(k, "restart")
    sid = start(k, task)
    configure(k, sid)
    before = k.show(sid)
    reset = k.cli("session", "reset-context", sid, "--restart")
    assert reset["path"] == "restart" and reset["runtime_config"] == CHOSEN
    show = k.show(sid)
    assert show["instance_id"] != before["instance_id"] and show["agent_pid"] != before["agent_pid"]
    assert show["live"] and show["runtime_config"] == CHOSEN
    new_acp = reset["acp_session_id"]
    assert identities(k, sid) == (new_acp, new_acp)
    log = agent_log(k, show["instance_id"])
    assert config_calls(log, new_acp) == [
        "set_config_option model=mock-smart", "set_mode mode=plan", "set_config_option effort=high"]
    assert provider_state(k, new_acp) == CHOSEN
    backend_log = (k.home / "logs" / "backend.log").read_text()
    ready = backend_log.index(f"session {sid} STARTING -> WAITING_FOR_INPUT (agent ready (context reset))")
    assert backend_log.index(f"session {sid} WAITING_FOR_INPUT -> STARTING (context reset") < ready
    k.cli("prompt", sid, "hi", "--wait")
    assert agent_chunks(k.show(sid))[-1] == "echo: hi"


@pytest.mark.parametrize("switch, field", [('reject_mode = "plan"\n', "mode"),
                                           ('reject_option = "effort=high"\n', "option effort")])
def test_rejected_field_fails_the_reset_and_blocks_the_step_prompt(kandev_factory, switch, field):
    """RESETCFG-9, RESETCFG-10, RESETCFG-11, RESETCFG-T3: the new session rejects one captured field:
    the reset fails, the execution is failed, the failure status is persisted, no ready or reset
    event is published, the workflow step's automatic prompt is not sent, and what the agent did
    accept is reported truthfully (also after a resume)."""
    k = kandev_factory()
    k.up()
    task, ws = new_task(k, "reject", "--steps", "plan,implement:reset:prompt=Implement it,review")
    sid = start(k, task)
    k.cli("prompt", sid, "plan it", "--wait")
    configure(k, sid)
    turns_before = len(k.show(sid)["turns"])
    switches(ws, switch)  # the next provider session rejects it (it was accepted by the old one)

    error = refused(k, "task", "proceed", task)
    assert error["code"] == "agent_error" and "automatic prompt was not sent" in error["message"]
    show = k.show(sid)
    assert show["state"] == "FAILED" and not show["live"]
    assert "context reset failed" in show["last_error"]
    status = metadata(k, sid)["context_reset"]
    assert status["status"] == "failed" and status["field"] == field and status["captured"] == CHOSEN
    kinds = [m["kind"] for m in show["transcript"]]
    assert "context_reset" not in kinds and kinds[-1] == "context_reset_failed"
    assert len(show["turns"]) == turns_before
    assert "Implement it" not in [m["text"] for m in show["transcript"] if m["kind"] == "prompt"]
    assert "Implement it" not in "".join(p.read_text() for p in (k.home / "logs" / "agents").glob("*.log"))
    backend_log = (k.home / "logs" / "backend.log").read_text()
    assert f"session {sid} STARTING -> FAILED (context reset failed" in backend_log
    assert "agent ready (context reset)" not in backend_log
    steps = {s["name"]: s for s in k.cli("task", "workflow", task)["steps"]}
    assert steps["implement"]["status"] == "blocked" and steps["plan"]["status"] == "done"
    assert "automatic prompt was not sent" in steps["implement"]["detail"]
    # the accepted state, truthfully: the model was accepted before the refusal
    accepted = dict(DEFAULTS, model="mock-smart")
    if field == "option effort":
        accepted["mode"] = "plan"
    assert show["runtime_config"] == accepted
    assert task in k.cli("board")["needs_attention"]

    # resume continues the new provider session, whose state is what the agent accepted
    new_acp = status["acp_session_id"]
    assert identities(k, sid) == (new_acp, new_acp)
    resumed = k.cli("resume", sid)
    assert resumed["acp_session_id"] == new_acp and resumed["runtime_config"] == accepted


def test_workflow_step_resets_then_prompts(kandev_factory):
    """RESETCFG-T5, RESETCFG-11 (success side): entering a step with reset and prompt resets context
    with the runtime configuration kept, then sends the step's prompt."""
    k = kandev_factory()
    k.up()
    task, ws = new_task(k, "steps", "--steps", "plan,implement:reset:prompt=Implement it,done")
    wfl = k.cli("task", "workflow", task)
    assert wfl["current"] == "plan" and [s["status"] for s in wfl["steps"]] == ["active", "pending", "pending"]
    assert refused(k, "task", "proceed", task)["code"] == "conflict"  # the step needs a running agent
    sid = start(k, task)
    configure(k, sid)
    out = k.cli("task", "proceed", task)
    assert out["step"] == "implement" and out["reset"]["runtime_config"] == CHOSEN
    assert out["prompt"]["sent"] is True
    done = wait_until(lambda: s if (s := k.show(sid))["turns"] and s["turns"][-1]["state"] == "finished" else None,
                      timeout=30)
    assert agent_chunks(done)[-1] == "echo: Implement it"
    assert done["runtime_config"] == CHOSEN
    assert provider_state(k, out["reset"]["acp_session_id"]) == CHOSEN
    wfl = k.cli("task", "workflow", task)
    assert wfl["current"] == "implement" and [s["status"] for s in wfl["steps"]] == ["done", "active", "pending"]
    last = k.cli("task", "proceed", task)  # a step with no actions needs nothing
    assert last["step"] == "done" and last["reset"] is None and last["prompt"] is None
    assert refused(k, "task", "proceed", task)["code"] == "conflict"


def test_configure_rejected_field_keeps_what_was_accepted(kandev_factory):
    """RESETCFG-8: state only from accepted answers; a refused field leaves the earlier ones applied."""
    k = kandev_factory()
    k.up()
    task, ws = new_task(k, "configure")
    sid = start(k, task)
    switches(ws, 'reject_mode = "plan"\n')
    error = refused(k, "session", "configure", sid, "--model", "mock-smart", "--mode", "plan")
    assert error["code"] == "agent_error" and "mode" in error["message"]
    show = k.show(sid)
    assert show["runtime_config"] == dict(DEFAULTS, model="mock-smart")
    assert provider_state(k, show["resume_token"]) == dict(DEFAULTS, model="mock-smart")
    assert refused(k, "session", "configure", sid, "--option", "model=mock-fast")["code"] == "invalid_argument"
    assert k.run("session", "configure", sid, "--option", "nonsense").returncode == 2
