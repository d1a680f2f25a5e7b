"""A real Codex doing real turns through kandev (Issue 22 scenario A, Issue 22 scenario B,
Issue 22 scenario C; Issue 22 item 1, Issue 22 item 3; Issue 44 scenario D: in its own network namespace, its provider's
stand-in reached through its egress proxy, listed in ``[network] host_ports``).

The agent is the pinned ``codex`` runtime (``@agentclientprotocol/codex-acp``, which runs the
native ``codex app-server`` of ``@openai/codex``; prepared once per machine:
``tests/support/npm_runtimes.py``), started by the real daemons in its sandbox, configured only
through ``[agents.codex]``: ``~/.codex/config.toml`` through ``home_files`` (a ``model_provider``
with the stand-in's ``base_url``, ``env_key = "OPENAI_API_KEY"``, ``wire_api = "responses"``), the
key through ``secret_env``. Its provider is the tests' Responses API stand-in
(``tests/support/responses_standin.py``); Codex sends the whole history every turn. One backend
(survival on) serves the module; kandev runs as root.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.support.npm_runtimes import cache_or_skip
from tests.support.processes import alive
from tests.support.real_agents import (
    TURN_TIMEOUT,
    AgentEnv,
    agent_process,
    assert_key_nowhere,
    not_root,
    running,
    start,
    turn,
    user_texts,
)
from tests.support.responses_standin import ResponsesStandIn
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

CONFIG = ".codex/config.toml"
MODEL = "gpt-6.1-sol"  # one of the pinned Codex's built-in models (else it warns in the transcript)


def _config(base_url: str) -> str:
    return (f'model = "{MODEL}"\nmodel_provider = "standin"\ncheck_for_update_on_startup = false\n\n'
            "[analytics]\nenabled = false\n\n"
            # Codex snapshots its login shell's environment, the key included, into
            # ~/.codex/shell_snapshots unless told not to.
            "[features]\nshell_snapshot = false\n\n"
            f'[model_providers.standin]\nname = "standin"\nbase_url = "{base_url}"\n'
            'env_key = "OPENAI_API_KEY"\nwire_api = "responses"\n')


@pytest.fixture(scope="module")
def env() -> Iterator[AgentEnv]:
    with running("codex", ResponsesStandIn(), cache_or_skip("codex"), key_var="OPENAI_API_KEY",
                 env=lambda s: {}, files=lambda s: {CONFIG: _config(s.base_url)}) as e:
        yield e


def test_scenario_a_first_turn_configured_only_through_kandev(env: AgentEnv) -> None:
    """Issue 22 scenario A, Issue 22 item 1: deltas in order, end_turn, the key at the stand-in (as
    a bearer token) and nowhere else; config.toml copied 0600 into the session's HOME; not root."""
    e = env
    sid = start(e, "codex A")
    deltas = ["Hello", " from", " the", " stand-in", ", in", " order."]
    e.standin.script(deltas, pace=0.05)
    before = len(e.standin.conversation())
    show = turn(e, sid, "say hi")
    assert agent_chunks(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"
    asked = e.standin.conversation()[before:]
    assert asked and ("user", "say hi") in asked[-1].texts()
    assert all(r.headers.get("authorization") == f"Bearer {e.key}" for r in e.standin.requests)

    proc = agent_process(show["agent_pid"], "codex")
    assert not_root(proc.pid)
    home = e.session_home(sid)
    assert proc.environ()["HOME"] == str(home)
    copied = home / CONFIG
    assert copied.read_text() == _config(e.standin.base_url) and (copied.stat().st_mode & 0o777) == 0o600
    agents = {a["name"]: a for a in e.k.cli("agents")["agents"]}
    assert CONFIG in agents["codex"]["home_files"]
    assert_key_nowhere(e, sid)


def test_scenario_b_backend_sigkilled_mid_stream(env: AgentEnv) -> None:
    """Issue 22 scenario B: the same Codex process finishes the turn the killed backend left;
    every delta once and in order."""
    e, k = env, env.k
    sid = start(e, "codex B")
    before = k.show(sid)
    deltas = [f"d{i:02d} " for i in range(12)]
    script = e.standin.script(deltas, pace=0.2, hold_after=4)
    k.cli("prompt", sid, "stream twelve")
    wait_until(lambda: len(agent_chunks(k.show(sid))) >= 4, timeout=TURN_TIMEOUT, message="4 deltas in the transcript")
    backend = k.backend_pid
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    script.release()
    k.up()
    show = wait_until(lambda: s if (s := k.show(sid))["retracked"] and s["state"] == "WAITING_FOR_INPUT" else None,
                      timeout=TURN_TIMEOUT, message="re-tracked and the turn ended")
    assert script.sent == len(deltas)
    assert (show["agent_pid"], show["agent_pid_start_time"]) == (before["agent_pid"], before["agent_pid_start_time"])
    assert agent_chunks(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"


def test_scenario_c_resume_loads_the_conversation(env: AgentEnv) -> None:
    """Issue 22 scenario C, Issue 22 item 3: after the group is killed, ``kandev resume`` loads the
    session (Codex replays its history before answering session/load, with no sessionId in the
    answer); the next request carries the earlier turn; no replayed duplicate in the transcript."""
    e, k = env, env.k
    sid = start(e, "codex C")
    e.standin.script(["The answer", " is 42."], pace=0.02)
    turn(e, sid, "what is the answer?")
    show = k.show(sid)
    token = show["resume_token"]
    os.killpg(show["agent_pid"], signal.SIGKILL)
    wait_until(lambda: not k.show(sid)["live"], timeout=30, message="the session saw its agent die")
    resumed = k.cli("resume", sid, timeout=180)
    assert resumed["loaded"] is True and resumed["acp_session_id"] == token
    before = len(e.standin.conversation())
    e.standin.script(["Still", " 42."])
    after = turn(e, sid, "and again?")
    assert agent_chunks(after) == ["The answer", " is 42.", "Still", " 42."]
    assert user_texts(after) == ["what is the answer?", "and again?"]
    texts = e.standin.conversation()[before:][-1].texts()
    assert texts.index(("user", "what is the answer?")) < texts.index(("assistant", "The answer is 42.")) \
        < texts.index(("user", "and again?"))
