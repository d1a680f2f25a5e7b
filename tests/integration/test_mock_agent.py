"""The built-in mock ACP agent, run as a real process and driven by the SDK client side.

Every wait is bounded (pytest-timeout per test plus asyncio timeouts inside);
the only sleeping is the agent's own ``/slow`` pacing. Each agent runs in its
own process group, which teardown kills.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import acp
import pytest
from acp import RequestError
from acp.schema import (
    AgentMessageChunk,
    AllowedOutcome,
    ConfigOptionUpdate,
    CurrentModeUpdate,
    DeniedOutcome,
    PermissionOption,
    RequestPermissionResponse,
    UserMessageChunk,
)

from daemon.agents.registry import get_agent
from tests.support.aio import run
from tests.support.paths import REPO_ROOT
from tests.support.waiting import wait_until

STEP = 15.0  # bound on any single protocol exchange, in seconds


class RecordingClient:
    """ACP client side: records session/update notifications, answers permission requests."""

    def __init__(self, permission_answer: str | None = "allow") -> None:
        self.permission_answer = permission_answer  # None: answer "cancelled"
        self.permission_requests: list[list[PermissionOption]] = []
        self.updates: list[Any] = []
        self._changed = asyncio.Event()

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        self.updates.append(update)
        self._changed.set()

    async def request_permission(
        self, session_id: str, tool_call: Any, options: list[PermissionOption], **kwargs: Any
    ) -> RequestPermissionResponse:
        self.permission_requests.append(options)
        if self.permission_answer is None:
            return RequestPermissionResponse(outcome=DeniedOutcome(outcome="cancelled"))
        return RequestPermissionResponse(
            outcome=AllowedOutcome(outcome="selected", option_id=self.permission_answer)
        )

    def chunks(self) -> list[tuple[str, str]]:
        """(role, text) of every message chunk received, in order."""
        out = []
        for u in self.updates:
            if isinstance(u, AgentMessageChunk | UserMessageChunk):
                out.append(("agent" if isinstance(u, AgentMessageChunk) else "user", u.content.text))
        return out

    def agent_texts(self) -> list[str]:
        return [text for role, text in self.chunks() if role == "agent"]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = STEP) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()


class AgentProc:
    def __init__(self, proc: asyncio.subprocess.Process, conn: Any, client: RecordingClient) -> None:
        self.proc = proc
        self.conn = conn
        self.client = client

    async def initialize(self) -> Any:
        return await asyncio.wait_for(self.conn.initialize(protocol_version=acp.PROTOCOL_VERSION), STEP)

    async def new_session(self, cwd: Path) -> Any:
        return await asyncio.wait_for(self.conn.new_session(cwd=str(cwd), mcp_servers=[]), STEP)

    async def prompt(self, session_id: str, text: str, timeout: float = STEP) -> str:
        resp = await asyncio.wait_for(
            self.conn.prompt(session_id=session_id, prompt=[acp.text_block(text)]), timeout
        )
        return resp.stop_reason

    async def exit_code(self) -> int:
        return await asyncio.wait_for(self.proc.wait(), STEP)


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "workspace"
    ws.mkdir()
    return ws


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def spawn(tmp_path: Path, state_dir: Path) -> Callable[..., Any]:
    """``async with spawn(cwd) as agent``: a mock agent process connected to a RecordingClient."""
    counter = iter(range(1000))

    @asynccontextmanager
    async def _spawn(
        cwd: Path, client: RecordingClient | None = None, state: Path | None = state_dir
    ) -> AsyncIterator[AgentProc]:
        env = {k: v for k, v in os.environ.items() if k != "KANDEV_MOCK_STATE_DIR"}
        env["PYTHONPATH"] = str(REPO_ROOT)
        if state is not None:
            env["KANDEV_MOCK_STATE_DIR"] = str(state)
        client = client or RecordingClient()
        stderr_path = tmp_path / f"agent-{next(counter)}.stderr"
        with stderr_path.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                *get_agent("mock").argv(),
                cwd=cwd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,
            )
        conn = acp.connect_to_agent(client, proc.stdin, proc.stdout)
        try:
            yield AgentProc(proc, conn, client)
        finally:
            await conn.close()
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), STEP)
            print(f"--- {stderr_path.name}\n{stderr_path.read_text()}")  # shown when the test fails

    return _spawn


def expected_stream(n: int) -> list[str]:
    return [f"{i}/{n} " for i in range(1, n + 1)]


@pytest.mark.timeout(60)
def test_initialize_and_new_session_advertise_capabilities(spawn, workspace, state_dir):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            init = await agent.initialize()
            assert init.protocol_version == acp.PROTOCOL_VERSION
            assert init.agent_capabilities.load_session is True
            new = await agent.new_session(workspace)
            assert len(new.session_id) == 32 and int(new.session_id, 16) >= 0
            assert new.modes.current_mode_id == "default"
            assert [m.id for m in new.modes.available_modes] == ["default", "plan"]
            options = {o.id: o for o in new.config_options}
            assert options["model"].category == "model"
            assert options["model"].current_value == "mock-fast"
            assert [o.value for o in options["model"].options] == ["mock-fast", "mock-smart"]
            assert options["effort"].current_value == "medium"
            assert [o.value for o in options["effort"].options] == ["low", "medium", "high"]
            state = json.loads((state_dir / f"{new.session_id}.json").read_text())
            assert state["mode"] == "default" and state["cwd"] == str(workspace)

    run(scenario())


@pytest.mark.timeout(60)
def test_state_dir_defaults_to_the_session_cwd(spawn, workspace, tmp_path):
    async def scenario() -> None:
        async with spawn(tmp_path, state=None) as agent:  # process cwd differs from session cwd
            await agent.initialize()
            new = await agent.new_session(workspace)
            assert await agent.prompt(new.session_id, "hi") == "end_turn"
        sessions = workspace / ".kandev-mock" / "sessions"
        assert (sessions / f"{new.session_id}.json").is_file()
        lines = (sessions / f"{new.session_id}.history.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [
            {"role": "user", "text": "hi"},
            {"role": "agent", "text": "echo: hi"},
        ]

    run(scenario())


@pytest.mark.timeout(60)
def test_plain_text_and_unknown_command_echo(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            assert await agent.prompt(sid, "hello world") == "end_turn"
            assert await agent.prompt(sid, "/nope 1") == "end_turn"
            assert agent.client.agent_texts() == ["echo: hello world", "echo: /nope 1"]

    run(scenario())


@pytest.mark.timeout(60)
def test_flood_arrives_complete_in_order_exactly_once(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            assert await agent.prompt(sid, "/flood 500") == "end_turn"
            assert agent.client.agent_texts() == expected_stream(500)

    run(scenario())


@pytest.mark.timeout(60)
def test_slow_streams_numbered_chunks(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            assert await agent.prompt(sid, "/slow 3", timeout=STEP + 3) == "end_turn"
            assert agent.client.agent_texts() == expected_stream(3)

    run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script,total", [("/slow 30", 30), ("/flood 1000000", 1_000_000)])
def test_cancel_stops_streaming(spawn, workspace, script, total):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            turn = asyncio.create_task(agent.prompt(sid, script))
            await agent.client.wait_for(lambda: len(agent.client.agent_texts()) >= 1)
            await agent.conn.cancel(session_id=sid)
            assert await turn == "cancelled"
            texts = agent.client.agent_texts()
            assert 1 <= len(texts) < total
            assert texts == expected_stream(total)[: len(texts)]
            # the session is still usable after a cancelled turn
            assert await agent.prompt(sid, "after") == "end_turn"
            assert agent.client.agent_texts()[-1] == "echo: after"

    run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "answer,text,stop_reason",
    [
        ("allow", "permission: allow", "end_turn"),
        ("reject", "permission: reject", "end_turn"),
        (None, "permission: cancelled", "cancelled"),
    ],
)
def test_permission_reports_the_answer(spawn, workspace, answer, text, stop_reason):
    async def scenario() -> None:
        async with spawn(workspace, RecordingClient(permission_answer=answer)) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            assert await agent.prompt(sid, "/permission") == stop_reason
            [options] = agent.client.permission_requests
            assert [(o.option_id, o.kind) for o in options] == [
                ("allow", "allow_once"),
                ("reject", "reject_once"),
            ]
            assert agent.client.agent_texts() == [text]

    run(scenario())


@pytest.mark.timeout(60)
def test_sh_runs_in_the_session_cwd_and_reports_exit_code_and_the_first_4_kib(spawn, workspace):
    """Issue 10 item 4: ``/sh CMD`` is ``sh -c CMD`` as the agent's child in the session's cwd;
    one chunk ``sh: exit=<code>``, a newline, the first 4 KiB of stdout and stderr combined."""
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            assert await agent.prompt(sid, "/sh pwd; echo oops >&2; echo $PPID; exit 3") == "end_turn"
            head, cwd, err, ppid = agent.client.agent_texts()[-1].splitlines()
            assert (head, cwd, err) == ("sh: exit=3", str(workspace), "oops") and int(ppid) == agent.proc.pid
            await agent.prompt(sid, "/sh yes kandev | head -c 100000")
            said = agent.client.agent_texts()[-1]
            assert said.startswith("sh: exit=0\n") and len(said) == len("sh: exit=0\n") + 4096
            assert await agent.prompt(sid, "/sh") == "end_turn"  # no command: plain text, echoed
            assert agent.client.agent_texts()[-1] == "echo: /sh"

    run(scenario())


@pytest.mark.timeout(60)
def test_sh_is_ended_by_a_cancel(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            turn = asyncio.ensure_future(agent.prompt(sid, "/sh touch started && sleep 300"))
            await asyncio.to_thread(wait_until, lambda: (workspace / "started").exists(), timeout=30)
            await agent.conn.cancel(session_id=sid)
            assert await turn == "cancelled"
            # SIGTERM reaches sh and its `sleep`: sh killed first reports -15; sh that saw its
            # command killed first exits 128 + 15 (and says "Terminated")
            assert agent.client.agent_texts()[-1].startswith(("sh: exit=-15", "sh: exit=143"))

    run(scenario())


@pytest.mark.timeout(60)
def test_fail_answers_the_prompt_with_an_error(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            with pytest.raises(RequestError) as err:
                await agent.prompt(sid, "/fail")
            assert err.value.code == -32603
            assert await agent.prompt(sid, "still here") == "end_turn"

    run(scenario())


@pytest.mark.timeout(60)
def test_exit_mid_turn_with_the_given_code(spawn, workspace):
    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            with pytest.raises(ConnectionError):
                await agent.prompt(sid, "/exit 7")
            assert await agent.exit_code() == 7
            assert agent.client.agent_texts() == ["exiting 7"]

    run(scenario())


@pytest.mark.timeout(60)
def test_fail_initialize_exits_3_without_answering(spawn, workspace):
    (workspace / ".kandev-mock.toml").write_text("fail_initialize = true\n")

    async def scenario() -> None:
        async with spawn(workspace) as agent:
            with pytest.raises(ConnectionError):
                await agent.initialize()
            assert await agent.exit_code() == 3

    run(scenario())


@pytest.mark.timeout(60)
def test_set_mode_and_config_option_and_reject_switches(spawn, workspace):
    switches = workspace / ".kandev-mock.toml"

    async def scenario() -> None:
        async with spawn(workspace) as agent:
            await agent.initialize()
            sid = (await agent.new_session(workspace)).session_id
            conn, client = agent.conn, agent.client

            await asyncio.wait_for(conn.set_session_mode(session_id=sid, mode_id="plan"), STEP)
            await client.wait_for(lambda: any(isinstance(u, CurrentModeUpdate) for u in client.updates))
            assert [u.current_mode_id for u in client.updates if isinstance(u, CurrentModeUpdate)] == ["plan"]

            resp = await asyncio.wait_for(
                conn.set_config_option(session_id=sid, config_id="model", value="mock-smart"), STEP
            )
            assert {o.id: o.current_value for o in resp.config_options} == {
                "model": "mock-smart",
                "effort": "medium",
            }
            await client.wait_for(lambda: any(isinstance(u, ConfigOptionUpdate) for u in client.updates))
            [update] = [u for u in client.updates if isinstance(u, ConfigOptionUpdate)]
            assert {o.id: o.current_value for o in update.config_options}["model"] == "mock-smart"

            for bad in (
                conn.set_session_mode(session_id=sid, mode_id="yolo"),
                conn.set_config_option(session_id=sid, config_id="model", value="gpt"),
                conn.set_config_option(session_id=sid, config_id="colour", value="red"),
            ):
                with pytest.raises(RequestError):
                    await asyncio.wait_for(bad, STEP)

            # switches are read at each request: flip them without restarting the agent
            await asyncio.wait_for(conn.set_session_mode(session_id=sid, mode_id="default"), STEP)
            switches.write_text('reject_mode = "plan"\nreject_option = "effort=high"\n')
            with pytest.raises(RequestError):
                await asyncio.wait_for(conn.set_session_mode(session_id=sid, mode_id="plan"), STEP)
            with pytest.raises(RequestError):
                await asyncio.wait_for(
                    conn.set_config_option(session_id=sid, config_id="effort", value="high"), STEP
                )
            resp = await asyncio.wait_for(
                conn.set_config_option(session_id=sid, config_id="effort", value="low"), STEP
            )
            assert {o.id: o.current_value for o in resp.config_options}["effort"] == "low"
            switches.unlink()
            await asyncio.wait_for(conn.set_session_mode(session_id=sid, mode_id="plan"), STEP)
            await asyncio.wait_for(
                conn.set_config_option(session_id=sid, config_id="effort", value="high"), STEP
            )
            modes = [u.current_mode_id for u in client.updates if isinstance(u, CurrentModeUpdate)]
            assert modes == ["plan", "default", "plan"]

    run(scenario())


@pytest.mark.timeout(60)
def test_load_in_a_new_process_replays_history_and_restores_config(spawn, workspace, state_dir):
    async def scenario() -> None:
        async with spawn(workspace) as first:
            await first.initialize()
            sid = (await first.new_session(workspace)).session_id
            assert await first.prompt(sid, "hello") == "end_turn"
            assert await first.prompt(sid, "/flood 3") == "end_turn"
            await asyncio.wait_for(first.conn.set_session_mode(session_id=sid, mode_id="plan"), STEP)
            await asyncio.wait_for(
                first.conn.set_config_option(session_id=sid, config_id="effort", value="high"), STEP
            )
            sent = first.client.chunks()
        assert sent == [("agent", "echo: hello"), *[("agent", t) for t in expected_stream(3)]]
        assert (state_dir / f"{sid}.json").is_file()

        expected = [
            ("user", "hello"),
            ("agent", "echo: hello"),
            ("user", "/flood 3"),
            ("agent", "".join(expected_stream(3))),  # replayed as one message (Issue 45 scenario A)
        ]
        async with spawn(workspace) as second:
            await second.initialize()
            resp = await asyncio.wait_for(second.conn.load_session(cwd=str(workspace), session_id=sid), STEP)
            await second.client.wait_for(lambda: len(second.client.chunks()) >= len(expected))
            assert second.client.chunks() == expected
            assert resp.modes.current_mode_id == "plan"
            assert {o.id: o.current_value for o in resp.config_options} == {
                "model": "mock-fast",
                "effort": "high",
            }
            assert await second.prompt(sid, "again") == "end_turn"

            with pytest.raises(RequestError):
                await asyncio.wait_for(
                    second.conn.load_session(cwd=str(workspace), session_id="0" * 32), STEP
                )

        async with spawn(workspace) as third:
            await third.initialize()
            await asyncio.wait_for(third.conn.load_session(cwd=str(workspace), session_id=sid), STEP)
            n = len(expected) + 2
            await third.client.wait_for(lambda: len(third.client.chunks()) >= n)
            assert third.client.chunks() == [*expected, ("user", "again"), ("agent", "echo: again")]

    run(scenario())


@pytest.mark.timeout(60)
def test_fail_load_switch_is_read_per_request(spawn, workspace):
    switches = workspace / ".kandev-mock.toml"

    async def scenario() -> None:
        async with spawn(workspace) as first:
            await first.initialize()
            sid = (await first.new_session(workspace)).session_id
        switches.write_text("fail_load = true\n")
        async with spawn(workspace) as second:
            await second.initialize()
            with pytest.raises(RequestError):
                await asyncio.wait_for(second.conn.load_session(cwd=str(workspace), session_id=sid), STEP)
            switches.write_text("fail_load = false\n")
            await asyncio.wait_for(second.conn.load_session(cwd=str(workspace), session_id=sid), STEP)
            assert await second.prompt(sid, "loaded") == "end_turn"

    run(scenario())


@pytest.mark.timeout(60)
def test_requests_are_logged_to_stderr_only(workspace, state_dir):
    """Raw stdio: stdout carries only JSON-RPC lines, stderr one log line per request."""
    requests = [
        {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}},
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "session/new",
            "params": {"cwd": str(workspace), "mcpServers": []},
        },
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KANDEV_MOCK_STATE_DIR": str(state_dir)}

    async def scenario() -> tuple[list[dict[str, Any]], str]:
        proc = await asyncio.create_subprocess_exec(
            *get_agent("mock").argv(),
            cwd=workspace,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            responses = []
            for request in requests:  # one at a time: stdin EOF makes the SDK drop unanswered requests
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                line = await asyncio.wait_for(proc.stdout.readline(), STEP)
                responses.append(json.loads(line))
            proc.stdin.close()
            assert await asyncio.wait_for(proc.stdout.read(), STEP) == b""
            assert await asyncio.wait_for(proc.wait(), STEP) == 0
            err = await asyncio.wait_for(proc.stderr.read(), STEP)
        finally:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await asyncio.wait_for(proc.wait(), STEP)
        return responses, err.decode()

    responses, log = run(scenario())
    assert [r["id"] for r in responses] == [0, 1]
    assert all("result" in r for r in responses)
    request_lines = [line for line in log.splitlines() if " initialize " in line or " session/" in line]
    assert len(request_lines) == 2, log
