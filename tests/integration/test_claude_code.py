"""A real Claude Code doing real turns through kandev (Issue 12 scenario A, Issue 12 scenario B, Issue 12 scenario C and Issue 12 scenario D).

The agent is the pinned ``claude-code`` runtime (``@zed-industries/claude-code-acp``, prepared once
per machine: ``tests/support/npm_runtimes.py``), started by the real daemons in its bubblewrap sandbox
as ``kandev session start --agent claude-code`` starts it; the model API is the tests' own local
stand-in (``tests/support/messages_standin.py``), reached through ``[agents.claude-code] env =
{ANTHROPIC_BASE_URL}`` and the agent's egress proxy (the stand-in listed in ``[network] host_ports``,
Issue 44 scenario D), with the key in a 0600 file named by ``secret_env``. One backend (survival
on, detached control server) serves the module; the tests run as root, so every one of them is also
Issue 12 scenario D (kandev running as root).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.kandev import Kandev, make_env
from tests.support.messages_standin import MessagesStandIn
from tests.support.processes import alive
from tests.support.real_agents import agent_process, files_holding, not_root
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

KEY_PREFIX, KEY_SUFFIX = "sk-ant-test-", secrets.token_hex(16)
KEY = KEY_PREFIX + KEY_SUFFIX  # the Anthropic key: never written in one piece anywhere the tests control
MOCK_TOKEN = "mock-" + secrets.token_hex(16)
TURN_TIMEOUT = 90


class Env:
    def __init__(self, k: Kandev, standin: MessagesStandIn, dir: Path) -> None:
        self.k, self.standin, self.dir = k, standin, dir
        self.key_file = dir / "secrets" / "anthropic-api-key"
        self.mock_file = dir / "secrets" / "mock-token"


@pytest.fixture(scope="module")
def env(claude_npm_cache: Path) -> Iterator[Env]:
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d, MessagesStandIn() as standin:
        os.chmod(d, 0o700)
        root = Path(d)
        (root / "secrets").mkdir(mode=0o700)
        e = Env(Kandev(root / "home", {}), standin, root)
        for path, value in ((e.key_file, KEY), (e.mock_file, MOCK_TOKEN)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, (value + "\n").encode())
            os.close(fd)
        config = root / "kandev.toml"
        config.write_text(
            "[features]\nagent_survival = true\n\n"
            + standin.network_table() +
            "[agents.claude-code]\n"
            f'env = {{ ANTHROPIC_BASE_URL = "{standin.base_url}" }}\n'
            f'secret_env = {{ ANTHROPIC_API_KEY = "{e.key_file}" }}\n\n'
            "[agents.mock]\n"
            f'secret_env = {{ MOCK_TOKEN = "{e.mock_file}" }}\n'
        )
        e.k.env = make_env(config, npm_config_cache=str(claude_npm_cache))
        try:
            e.k.up()
            yield e
        finally:
            e.k.cleanup()


def _start_claude(e: Env, title: str) -> tuple[str, str]:
    task = e.k.cli("task", "create", "--title", title)["task_id"]
    sid = e.k.cli("session", "start", task, "--agent", "claude-code", timeout=180)["session_id"]
    e.k.show(sid)
    return task, sid


def _turn(e: Env, sid: str, text: str) -> dict[str, Any]:
    result = e.k.cli("prompt", sid, text, "--wait", timeout=TURN_TIMEOUT)
    assert result["stop_reason"] == "end_turn", result
    return e.k.show(sid)


def _conversation_holds(home: Path, sid: str, text: str) -> bool:
    """Whether a conversation file of Claude Code in the session's agent HOME holds ``text``."""
    projects = home / "sessions" / sid / "agent" / "home" / ".claude" / "projects"
    return any(text.encode() in f.read_bytes() for f in projects.glob("*/*.jsonl")) if projects.is_dir() else False


def _texts(show: dict[str, Any]) -> list[str]:
    return [c for c in agent_chunks(show) if c]  # Claude Code opens a text block with an empty chunk


def _argv_holding(needle: str) -> list[int]:
    hits = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle.encode() in (p / "cmdline").read_bytes():
                    hits.append(int(p.name))
            except OSError:
                continue
    return hits


def test_scenario_a_d_claude_code_turn_with_its_key_from_a_0600_file(env: Env) -> None:
    """Issue 12 scenario A (and D: these tests run kandev as root): a claude-code session's turn
    completes with the streamed text in order; the stand-in saw the key; the key's value is in no
    file under the kandev home (the agent's HOME included), no log, no ``session show``, no argv,
    nor anywhere a mock agent's ``/sh`` reaches (which gets its own secret, and not another
    session's HOME). The agent is not root inside its sandbox, and its HOME is its session's."""
    e, k = env, env.k
    _task, sid = _start_claude(e, "claude A")
    deltas = ["Hello", " from", " the", " stand-in", ", in", " order."]
    e.standin.script(deltas, pace=0.05)
    before = len(e.standin.conversation())
    show = _turn(e, sid, "say hi")
    assert _texts(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"
    asked = e.standin.conversation()[before:]
    assert asked and all(r.headers.get("x-api-key") == KEY for r in asked)
    assert all(r.headers.get("x-api-key") == KEY for r in e.standin.requests)

    # D: kandev runs as root here, the agent does not (and Claude Code refuses root anyway).
    node = agent_process(show["agent_pid"], "claude-code-acp")
    assert not_root(node.pid)  # kandev as root: the agent is kandev-agent, never host or namespace uid 0
    environ = node.environ()
    home = k.home / "sessions" / sid / "agent" / "home"
    assert environ["HOME"] == str(home)
    assert (home / ".claude").is_dir()  # its own storage, in its session's HOME
    assert environ["DISABLE_TELEMETRY"] == "1" and environ["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert environ["ANTHROPIC_API_KEY"] == KEY  # its own credential, in its own environment only

    # The mock agent: its own secret, none of the claude session's, nothing of another session.
    mock_task = k.cli("task", "create", "--title", "mock A")["task_id"]
    msid = k.cli("session", "start", mock_task)["session_id"]
    wait_until(lambda: k.show(msid)["state"] == "WAITING_FOR_INPUT", timeout=30)
    script = (
        f"printf %s {KEY_PREFIX} > /tmp/k; printf %s {KEY_SUFFIX} >> /tmp/k; "
        "echo env:$(env | grep -cFf /tmp/k); "
        "echo mock:$(printf %s \"$MOCK_TOKEN\" | sha256sum | cut -c1-16); "
        f"cat {e.key_file} >/dev/null 2>&1 && echo keyfile:readable || echo keyfile:absent; "
        f"ls {home} >/dev/null 2>&1 && echo otherhome:visible || echo otherhome:absent; "
        # All it can read but the host's read-only system (/usr, /opt): kandev writes to neither,
        # and /opt alone can hold gigabytes, more than a turn's time to read from a cold cache.
        "echo found:$( (grep -rlsFf /tmp/k --exclude=k --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev"
        " --exclude-dir=usr --exclude-dir=opt / ; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline;"
        " do grep -lsFf /tmp/k $f; done)"
        " | tr '\\n' ' '):end"
    )
    k.cli("prompt", msid, f"/sh {script}", "--wait", timeout=TURN_TIMEOUT)
    said = "".join(agent_chunks(k.show(msid)))
    assert "sh: exit=0" in said, said
    assert "env:0" in said and "keyfile:absent" in said and "otherhome:absent" in said, said
    assert f"mock:{hashlib.sha256(MOCK_TOKEN.encode()).hexdigest()[:16]}" in said, said
    assert "found::end" in said, said

    # Nothing kandev wrote holds either secret; no process shows one in its argv.
    for needle in (KEY, MOCK_TOKEN):
        assert files_holding(k.home, needle.encode()) == []
        assert needle not in k.run("session", "show", sid).stdout + k.human("session", "show", sid).stdout
        assert needle not in k.run("session", "show", msid).stdout
        assert _argv_holding(needle) == []
    agents = k.cli("agents")["agents"]
    claude = next(a for a in agents if a["name"] == "claude-code")
    assert claude["secret_env"] == {"ANTHROPIC_API_KEY": str(e.key_file)} and "ANTHROPIC_BASE_URL" in claude["env"]
    assert KEY not in k.run("agents").stdout + k.run("doctor").stdout


def test_scenario_b_backend_sigkilled_mid_stream(env: Env) -> None:
    """Issue 12 scenario B: survival on, a claude-code turn streaming 20 deltas over ~10 s; the
    backend is SIGKILLed mid-stream (the stand-in holds the stream after 5 deltas until the kill)
    and restarted: the same agent (pid and start time), re-tracked, every delta exactly once and in
    order, the turn ends end_turn."""
    e, k = env, env.k
    _task, sid = _start_claude(e, "claude B")
    before = k.show(sid)
    deltas = [f"d{i:02d} " for i in range(20)]
    script = e.standin.script(deltas, pace=0.5, hold_after=5)
    k.cli("prompt", sid, "stream twenty")
    wait_until(lambda: len(_texts(k.show(sid))) >= 5, timeout=TURN_TIMEOUT, message="5 deltas in the transcript")
    backend = k.backend_pid
    os.kill(backend, signal.SIGKILL)
    wait_until(lambda: not alive(backend), timeout=10)
    script.release()  # the rest streams while no backend is there
    k.up()
    show = wait_until(lambda: s if (s := k.show(sid))["retracked"] and s["state"] == "WAITING_FOR_INPUT" else None,
                      timeout=TURN_TIMEOUT, message="re-tracked and the turn ended")
    assert script.sent == 20
    assert (show["agent_pid"], show["agent_pid_start_time"]) == (before["agent_pid"], before["agent_pid_start_time"])
    assert alive(show["agent_pid"])
    assert _texts(show) == deltas
    assert show["turns"][-1]["stop_reason"] == "end_turn"


def test_scenario_c_resume_loads_the_conversation(env: Env) -> None:
    """Issue 12 scenario C: after a finished turn the agent process is killed; ``kandev resume``
    starts a new claude-code process that loads the session (ACP session/load, from the HOME kept
    in the session's own directory); the next prompt's request to the stand-in carries the earlier
    turn's user and assistant messages."""
    e, k = env, env.k
    _task, sid = _start_claude(e, "claude C")
    e.standin.script(["The answer", " is 42."], pace=0.02)
    first = _turn(e, sid, "what is the answer?")
    old_pid = first["agent_pid"]
    # Claude Code writes the turn into its conversation file after the turn ends; a kill before
    # that (the CLI's quick path made the calls in between ~15 ms shorter) leaves nothing to load.
    wait_until(lambda: _conversation_holds(k.home, sid, "is 42."), timeout=30,
               message="Claude Code wrote the first turn to its conversation file")
    os.killpg(old_pid, signal.SIGKILL)
    wait_until(lambda: not k.show(sid)["live"], timeout=30, message="the session saw its agent die")
    resumed = k.cli("resume", sid, timeout=180)
    assert resumed["loaded"] is True and resumed["fresh"] is False
    show = k.show(sid)
    assert show["live"] and show["agent_pid"] != old_pid
    assert alive(show["agent_pid"])
    before = len(e.standin.conversation())
    e.standin.script(["Still", " 42."])
    after = _turn(e, sid, "and again?")
    assert _texts(after)[-2:] == ["Still", " 42."]
    request = e.standin.conversation()[before:][-1]
    texts = request.texts()
    assert ("user", "what is the answer?") in texts
    assert ("assistant", "The answer is 42.") in texts
    assert texts.index(("user", "what is the answer?")) < texts.index(("assistant", "The answer is 42.")) \
        < texts.index(("user", "and again?"))
