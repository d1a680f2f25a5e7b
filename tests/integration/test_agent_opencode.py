"""A real OpenCode doing real turns through kandev (Issue 22 scenario A, Issue 22 scenario B,
Issue 22 scenario C, Issue 22 scenario D; Issue 22 item 1, Issue 22 item 2, Issue 22 item 3; Issue 44 scenario D: in its own network namespace, its provider's
stand-in reached through its egress proxy, listed in ``[network] host_ports``).

The agent is the pinned ``opencode`` runtime (``opencode-ai``, its native binary; prepared once per
machine: ``tests/support/npm_runtimes.py``), started by the real daemons in its sandbox, configured
only through ``[agents.opencode]``: ``~/.config/opencode/opencode.json`` through ``home_files``
(the provider's address, the key as ``{env:ANTHROPIC_API_KEY}``), the key through ``secret_env``.
Its provider is the tests' Messages API stand-in (``tests/support/messages_standin.py``). One
backend (survival on) serves the module; kandev runs as root.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import pytest

from tests.support.messages_standin import MessagesStandIn
from tests.support.npm_runtimes import cache_or_skip
from tests.support.processes import alive
from tests.support.real_agents import (
    TURN_TIMEOUT,
    AgentEnv,
    agent_process,
    assert_key_nowhere,
    not_root,
    running,
    source_name,
    start,
    turn,
    user_texts,
)
from tests.support.sessions import identities, refused
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

CONFIG = ".config/opencode/opencode.json"


def _config(base_url: str) -> str:
    return json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "model": "anthropic/claude-sonnet-4-5",
        "autoupdate": False,
        "share": "disabled",
        "provider": {"anthropic": {"options": {"baseURL": f"{base_url}/v1", "apiKey": "{env:ANTHROPIC_API_KEY}"}}},
    })


@pytest.fixture(scope="module")
def env() -> Iterator[AgentEnv]:
    with running("opencode", MessagesStandIn(), cache_or_skip("opencode"), key_var="ANTHROPIC_API_KEY",
                 env=lambda s: {}, files=lambda s: {CONFIG: _config(s.base_url)}) as e:
        yield e


def _killed_after_a_turn(e: AgentEnv, title: str) -> tuple[str, str]:
    sid = start(e, title)
    e.standin.script(["The answer", " is 42."], pace=0.02)
    turn(e, sid, "what is the answer?")
    show = e.k.show(sid)
    token = show["resume_token"]
    os.killpg(show["agent_pid"], signal.SIGKILL)
    wait_until(lambda: not e.k.show(sid)["live"], timeout=30, message="the session saw its agent die")
    return sid, token


def test_scenario_a_first_turn_configured_only_through_kandev(env: AgentEnv) -> None:
    """Issue 22 scenario A, Issue 22 item 1, Issue 22 item 2: deltas in order, end_turn, the key at
    the stand-in and nowhere else; the configuration file copied 0600 into the session's HOME; the
    no-phoning-home defaults in the agent's environment; the agent is not root."""
    e = env
    sid = start(e, "opencode A")
    deltas = ["Hello", " from", " the", " stand-in", ", in", " order."]
    e.standin.script(deltas, pace=0.05)
    before = len(e.standin.conversation())
    show = turn(e, sid, "say hi")
    assert agent_chunks(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"
    asked = e.standin.conversation()[before:]
    assert asked and all(r.headers.get("x-api-key") == e.key for r in e.standin.requests)

    proc = agent_process(show["agent_pid"], "opencode")
    assert not_root(proc.pid)
    environ = proc.environ()
    home = e.session_home(sid)
    assert environ["HOME"] == str(home)
    for var in ("OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_AUTOUPDATE"):
        assert environ[var] == "1"
    # npm offline: no background install of OpenCode's plugin package into its config directory
    assert environ["npm_config_offline"] == "true"
    assert not (home / ".config/opencode/node_modules").exists()
    copied = home / CONFIG
    assert copied.read_text() == _config(e.standin.base_url) and (copied.stat().st_mode & 0o777) == 0o600
    agents = {a["name"]: a for a in e.k.cli("agents")["agents"]}
    assert CONFIG in agents["opencode"]["home_files"]
    assert_key_nowhere(e, sid)


def test_scenario_b_backend_sigkilled_mid_stream(env: AgentEnv) -> None:
    """Issue 22 scenario B: the same OpenCode process finishes the turn the killed backend left;
    every delta once and in order."""
    e, k = env, env.k
    sid = start(e, "opencode B")
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
    session (OpenCode replays its history before answering session/load, with no sessionId in the
    answer); the next request carries the earlier turn; no replayed duplicate in the transcript."""
    e, k = env, env.k
    sid, token = _killed_after_a_turn(e, "opencode C")
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


def test_scenario_d_child_exits_before_initialize_keeps_the_token(env: AgentEnv) -> None:
    """Issue 22 scenario D, Issue 22 item 3: a broken opencode.json (through home_files) makes
    OpenCode exit before answering initialize: the resume fails saying why, the session shows the
    normal recovery action and keeps the same token; the fixed file lets the next resume load
    that same session."""
    e, k = env, env.k
    sid, token = _killed_after_a_turn(e, "opencode D")
    e.write_file(source_name(CONFIG), '{"provider": {"anthropic": ')  # not JSON
    try:
        error = refused(k, "resume", sid)
        assert error["code"] == "agent_error" and "initialize" in error["message"], error
        assert "keeps its resume token" in error["message"]
        show = k.show(sid)
        assert show["recoverable"] and not show["live"] and show["resume_token"] == token
        assert identities(k, sid) == (token, token)
        assert f"kandev resume {sid[:8]}" in k.human("session", "show", sid).stdout
    finally:
        e.write_file(source_name(CONFIG), _config(e.standin.base_url))
    resumed = k.cli("resume", sid, timeout=180)
    assert resumed["loaded"] is True and resumed["acp_session_id"] == token
    e.standin.script(["Back", "."])
    after = turn(e, sid, "still there?")
    assert agent_chunks(after)[-2:] == ["Back", "."]
    assert ("assistant", "The answer is 42.") in e.standin.conversation()[-1].texts()
