"""A real Gemini CLI doing real turns through kandev (Issue 22 scenario A, Issue 22 scenario B,
Issue 22 scenario C; Issue 22 item 1, Issue 22 item 2, Issue 22 item 3; Issue 44 scenario D: in its own network namespace, its provider's
stand-in reached through its egress proxy, listed in ``[network] host_ports``).

The agent is the pinned ``gemini`` runtime (``@google/gemini-cli`` started with ``--acp``; prepared
once per machine: ``tests/support/npm_runtimes.py``), started by the real daemons in its sandbox,
configured only through ``[agents.gemini]``: ``GOOGLE_GEMINI_BASE_URL`` in ``env``, the key
(``GEMINI_API_KEY``) through ``secret_env``, ``~/.gemini/settings.json`` (the API-key sign-in, no
updates, no usage statistics) through ``home_files``. Its provider is the tests' Gemini API
stand-in (``tests/support/gemini_standin.py``). One backend (survival on) serves the module;
kandev runs as root.

Gemini CLI replays a loaded session's history *after* answering ``session/load``, and cannot load
a session within the UTC minute its chat file was named in (the loading process starts a file of
the same name). Issue 22 scenario C therefore loads only once the minute has turned (``wait_until`` on the
clock, never luck), and its first turn runs at module setup so the wait is usually over by then.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest

from tests.support.gemini_standin import GeminiStandIn
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
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

SETTINGS = ".gemini/settings.json"
SETTINGS_TEXT = json.dumps({
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
})


def _utc_minute() -> int:
    return int(time.time() // 60)


@pytest.fixture(scope="module")
def env() -> Iterator[AgentEnv]:
    with running("gemini", GeminiStandIn(), cache_or_skip("gemini"), key_var="GEMINI_API_KEY",
                 env=lambda s: {"GOOGLE_GEMINI_BASE_URL": s.base_url},
                 files=lambda s: {SETTINGS: SETTINGS_TEXT}) as e:
        yield e


@pytest.fixture(scope="module")
def answered(env: AgentEnv) -> tuple[str, int]:
    """Issue 22 scenario C's session after its first turn, and the UTC minute that turn ended in."""
    sid = start(env, "gemini C")
    env.standin.script(["The answer", " is 42."], pace=0.02)
    turn(env, sid, "what is the answer?")
    return sid, _utc_minute()


def test_scenario_a_first_turn_configured_only_through_kandev(env: AgentEnv, answered: tuple[str, int]) -> None:
    """Issue 22 scenario A, Issue 22 item 1, Issue 22 item 2: deltas in order, end_turn, the key at
    the stand-in (``x-goog-api-key``) and nowhere else; settings.json copied 0600 into the session's
    HOME; the trust and no-telemetry defaults in the agent's environment; not root."""
    e = env
    sid = start(e, "gemini A")
    deltas = ["Hello", " from", " the", " stand-in", ", in", " order."]
    e.standin.script(deltas, pace=0.05)
    before = len(e.standin.conversation())
    show = turn(e, sid, "say hi")
    assert agent_chunks(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"
    asked = e.standin.conversation()[before:]
    assert asked and ("user", "say hi") in asked[-1].texts()
    assert all(r.headers.get("x-goog-api-key") == e.key for r in e.standin.requests)

    proc = agent_process(show["agent_pid"], "gemini")
    assert not_root(proc.pid)
    environ = proc.environ()
    home = e.session_home(sid)
    assert environ["HOME"] == str(home)
    assert environ["GEMINI_CLI_TRUST_WORKSPACE"] == "true" and environ["GEMINI_TELEMETRY_ENABLED"] == "false"
    copied = home / SETTINGS
    # Gemini CLI rewrites its settings (indented) once it has read them; they hold what was copied
    assert json.loads(copied.read_text()) == json.loads(SETTINGS_TEXT) and (copied.stat().st_mode & 0o777) == 0o600
    agents = {a["name"]: a for a in e.k.cli("agents")["agents"]}
    assert SETTINGS in agents["gemini"]["home_files"]
    assert_key_nowhere(e, sid)


def test_scenario_b_backend_sigkilled_mid_stream(env: AgentEnv) -> None:
    """Issue 22 scenario B: the same Gemini CLI process finishes the turn the killed backend left;
    every delta once and in order."""
    e, k = env, env.k
    sid = start(e, "gemini B")
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


def test_scenario_c_resume_loads_the_conversation(env: AgentEnv, answered: tuple[str, int]) -> None:
    """Issue 22 scenario C, Issue 22 item 3: after the group is killed (and once the UTC minute of
    the first turn is over), ``kandev resume`` loads the session; Gemini replays the history after
    its answer, and none of it reaches the transcript or the next turn; the next request carries
    the earlier turn."""
    e, k = env, env.k
    sid, minute = answered
    show = k.show(sid)
    token = show["resume_token"]
    os.killpg(show["agent_pid"], signal.SIGKILL)
    wait_until(lambda: not k.show(sid)["live"], timeout=30, message="the session saw its agent die")
    wait_until(lambda: _utc_minute() > minute, timeout=70, message="the UTC minute of the first turn is over")
    resumed = k.cli("resume", sid, timeout=180)
    assert resumed["loaded"] is True and resumed["acp_session_id"] == token
    before = len(e.standin.conversation())
    e.standin.script(["Still", " 42."])
    after = turn(e, sid, "and again?")
    assert agent_chunks(after) == ["The answer", " is 42.", "Still", " 42."]
    assert user_texts(after) == ["what is the answer?", "and again?"]
    texts = e.standin.conversation()[before:][-1].texts()
    assert texts.index(("user", "what is the answer?")) < texts.index(("model", "The answer is 42.")) \
        < texts.index(("user", "and again?"))
