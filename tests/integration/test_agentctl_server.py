"""``kandev-agentctl`` as a real process, driven through the real client over its real socket.

Every test starts its own control server (``python -m daemon.agentctl.main
--launch-file ...``, in its own session) on a private home, and drives the
real mock agent (``python -m daemon.agents.mock``). Every wait is bounded; the
teardown SIGTERMs, then SIGKILLs, the server and every agent process group a
test saw. AC ids are cited where a test proves one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from daemon.agentctl import auth
from daemon.agentctl.client.handshake import OwnershipRefused, identify
from daemon.agentctl.protocol import CAPABILITIES, EventKind
from daemon.agentctl.protocol import VERSION as PROTOCOL_VERSION
from ipc.client import AsyncClient, Event
from ipc.errors import ErrorCode, IpcError
from tests.support.agentctl import MOCK, STEP, Server, server_env, start_server, stop_server, write_launch
from tests.support.aio import run
from tests.support.paths import REPO_ROOT
from tests.support.processes import group_exists
from tests.support.streams import chunks, collect_until, turn_ended, wait_instance, wait_outcome
from tests.support.waiting import eventually, wait_until
from tests.support.wire import read_frame_body

pytestmark = pytest.mark.timeout(180)


def _killpg_refused(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------- ownership and authentication


def test_identify_reports_identity_capabilities_period_and_no_path(server: Server):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.11: identify returns exactly three things, no path."""
    info = run(identify(server.socket_path))
    assert info is not None
    assert set(info) == {"server_identity", "capabilities", "protocol_version", "unowned_period_s"}
    assert re.fullmatch(r"[0-9a-f]{32}", info["server_identity"])
    assert sorted(info["capabilities"]) == sorted(CAPABILITIES)
    assert info["protocol_version"] == list(PROTOCOL_VERSION)
    assert info["unowned_period_s"] == 600.0
    flat = json.dumps(info)
    assert "/" not in flat and str(server.home) not in flat


def test_identify_helper_returns_none_when_nothing_answers(short_tmp: Path):
    assert run(identify(str(short_tmp / "nothing.sock"), timeout=1.0)) is None
    stale = short_tmp / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on: ECONNREFUSED
    assert run(identify(str(stale), timeout=1.0)) is None


def test_identity_is_per_launch(short_tmp: Path):
    srv = write_launch(short_tmp)
    identities = []
    try:
        for _ in range(2):
            start_server(srv)
            identities.append(run(identify(srv.socket_path))["server_identity"])
            stop_server(srv)
    finally:
        stop_server(srv)
    assert identities[0] != identities[1]


def test_connect_proves_then_authenticates(server: Server):
    async def scenario() -> None:
        client = await server.connect()
        try:
            assert client.capabilities == frozenset(CAPABILITIES)
            assert client.unowned_period_s == 600.0
            assert await client.list_instances() == []
            assert await client.claim() == {"unowned_period_s": 600.0}
        finally:
            await client.close()

    run(scenario())
    assert server.ops_by_connection()[max(server.ops_by_connection())] == [
        "identify", "prove", "auth_begin", "auth_finish", "list_instances", "claim",
    ]


@pytest.mark.parametrize("wrong", ["credential", "installation_id"])
def test_wrong_credential_is_refused_before_anything_else_is_sent(server: Server, wrong: str):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.10: the server's proof is checked before the backend sends
    anything else; a mismatch is authentication_failure and only identify + prove were sent."""
    kw: dict[str, Any] = {"credential": auth.new_credential()} if wrong == "credential" else {
        "installation_id": os.urandom(16).hex()
    }
    with pytest.raises(OwnershipRefused) as info:
        run(server.connect(**kw))
    assert info.value.reason == "authentication_failure"
    ops = wait_until(server.ops_once_ended, timeout=STEP, message="every connection's end logged")
    refused = [o for o in ops.values() if "prove" in o]
    assert refused == [["identify", "prove"]], ops
    assert "agentctl_auth_failed" not in server.log_text()  # the client never even tried auth


def test_identity_mismatch_sends_only_identify(server: Server):
    with pytest.raises(OwnershipRefused) as info:
        run(server.connect(expected_identity="0" * 32))
    assert info.value.reason == "identity_mismatch"
    ops = wait_until(server.ops_once_ended, timeout=STEP, message="every connection's end logged")
    assert list(ops.values())[-1] == ["identify"]


def test_unauthenticated_connections_are_refused(server: Server):
    """docs/architecture.md#ownership: every op but identify/prove/auth_* needs an authenticated connection;
    a failed auth_finish consumes its nonce."""

    async def scenario() -> None:
        conn = await AsyncClient.connect(server.socket_path, hello=False)
        try:
            for op, args in [
                ("list_instances", {}),
                ("claim", {}),
                ("ownership_shutdown", {}),
                ("ack_turn", {"turn_id": "x"}),
            ]:
                with pytest.raises(IpcError) as info:
                    await conn.call(op, args, timeout=STEP)
                assert info.value.code == ErrorCode.UNAUTHENTICATED, op
            with pytest.raises(IpcError) as info:
                await conn.call("auth_finish", {"proof": b"x" * 32}, timeout=STEP)
            assert info.value.code == ErrorCode.UNAUTHENTICATED
            with pytest.raises(IpcError) as info:
                await conn.call("prove", {"challenge": b"short"}, timeout=STEP)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT
            identity = (await conn.call("identify"))["server_identity"]
            nonce = (await conn.call("auth_begin"))["nonce"]
            with pytest.raises(IpcError) as info:
                await conn.call("auth_finish", {"proof": auth.connection_proof(auth.new_credential(), nonce, identity)})
            assert info.value.code == ErrorCode.UNAUTHENTICATED
            # the right proof for the consumed nonce is refused too
            with pytest.raises(IpcError) as info:
                await conn.call("auth_finish", {"proof": auth.connection_proof(server.credential, nonce, identity)})
            assert info.value.code == ErrorCode.UNAUTHENTICATED
            with pytest.raises(IpcError) as info:
                await conn.call("list_instances")
            assert info.value.code == ErrorCode.UNAUTHENTICATED
            # a fresh nonce with the right credential works
            nonce = (await conn.call("auth_begin"))["nonce"]
            await conn.call("auth_finish", {"proof": auth.connection_proof(server.credential, nonce, identity)})
            assert (await conn.call("list_instances")) == {"instances": []}
        finally:
            await conn.close()

    run(scenario())
    assert "agentctl_auth_failed" in server.log_text()


# ---------------------------------------------------------------- instances


def test_instance_runs_in_its_own_process_group_and_is_enumerated(server: Server):
    """AC-EXECUTORS-SURVIVAL-002.1: enumeration carries the session and task ids the server holds,
    never the environment."""
    secret = "do-not-leak-" + os.urandom(8).hex()

    async def scenario() -> dict[str, Any]:
        async with await server.connect() as client:
            env = {"KANDEV_MOCK_STATE_DIR": str(server.mock_state), "PYTHONPATH": str(REPO_ROOT), "TOKEN": secret}
            created = await server.create(client, session_id="S-42", task_id="T-7", env=env,
                                          workspace_roots=[str(server.workspace)])
            listed = await client.list_instances()
            return {"created": created, "listed": listed}

    out = run(scenario())
    created, listed = out["created"], out["listed"]
    pid = created["pid"]
    assert os.getpgid(pid) == pid != os.getpgid(server.proc.pid)
    assert os.getsid(pid) == pid
    assert created["pid_start_time"] == pytest.approx(psutil.Process(pid).create_time(), abs=0.05)
    assert re.fullmatch(r"[0-9a-f]{32}", created["instance_id"])
    assert created["acp_session_id"]
    (entry,) = listed
    assert entry["instance_id"] == created["instance_id"]
    assert (entry["session_id"], entry["task_id"], entry["agent"]) == ("S-42", "T-7", "mock")
    assert entry["state"] == "running" and entry["pid"] == pid and entry["exit_code"] is None
    assert entry["acp_session_id"] == created["acp_session_id"]
    assert entry["workspace_roots"] == [str(server.workspace)] and entry["cwd"] == str(server.workspace)
    assert entry["attached"] is False and entry["current_turn_id"] is None
    assert "env" not in entry and secret not in json.dumps(listed)
    # the agent's environment is the minimal one plus the request's
    agent_env = psutil.Process(pid).environ()
    assert agent_env["TOKEN"] == secret
    assert not any(k.startswith("KANDEV_") and k != "KANDEV_MOCK_STATE_DIR" for k in agent_env)
    # and stderr goes to its own file under the agent log dir
    assert (server.home / "logs" / "agents" / f"{created['instance_id']}.stderr.log").exists()


def test_issue_10_agents_run_in_their_sandbox_unless_the_policy_is_off(server: Server):
    """Issue 10 scenario A at the control server: ``sandbox_status`` (authenticated; identify stays
    pathless) says a sandbox can be made; a required sandbox (the default) runs the agent under
    bwrap as its group leader, in its own pid namespace (it sees only its own tree), unable to
    see the server's home; ``policy: off`` runs it as before. Both are enumerated with
    ``sandboxed``."""

    async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]], list[Event], list[Event]]:
        async with await server.connect() as client:
            status = await client.sandbox_status(refresh=True)
            boxed = await server.create(client, session_id="boxed")
            plain = await server.create(client, session_id="plain", sandbox={"policy": "off"})
            listed = await client.list_instances()
            out = []
            for created in (boxed, plain):
                iid = created["instance_id"]
                probe = f"/sh ls /proc | grep -c '^[0-9]'; ls {server.home}/agentctl"
                turn = await client.prompt(iid, probe)
                await wait_outcome(client, iid, turn)
                stream = await client.attach(iid, 0)
                try:
                    out.append(await collect_until(stream, turn_ended(turn)))
                finally:
                    await stream.close()
            return status, listed, out[0], out[1]

    status, listed, boxed_events, plain_events = run(scenario())
    assert status["available"] is True and status["mechanism"] == "bubblewrap" and status["reason"] is None
    by_session = {e["session_id"]: e for e in listed}
    assert by_session["boxed"]["sandboxed"] is True and by_session["plain"]["sandboxed"] is False
    leader = psutil.Process(by_session["boxed"]["pid"])
    assert os.path.basename(leader.cmdline()[0]) == "bwrap" and leader.pid == os.getpgid(leader.pid)
    assert os.path.basename(psutil.Process(by_session["plain"]["pid"]).cmdline()[0]).startswith("python")
    boxed_said, plain_said = chunks(boxed_events)[-1], chunks(plain_events)[-1]
    processes = int(boxed_said.splitlines()[1])
    assert processes <= 8, boxed_said  # its own tree: bwrap's init, env/mock, sh, ls, grep
    assert "credential" not in boxed_said and not boxed_said.startswith("sh: exit=0\n"), boxed_said
    # what a guest must not see: the host's processes, the server's credential
    assert int(plain_said.splitlines()[1]) > processes and "credential" in plain_said, plain_said


def test_slow_prompt_streams_chunks_in_order_then_turn_ended(server: Server):
    """docs/architecture.md#processes: seq follows arrival order; turn_ended comes after every update of its turn."""

    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            stream = await client.attach(iid, 0)
            try:
                turn = await client.prompt(iid, "/slow 3")
                return await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()

    events = run(scenario())
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert [e.kind for e in events] == ["turn_started"] + ["session_update"] * 3 + ["turn_ended"]
    assert chunks(events) == ["1/3 ", "2/3 ", "3/3 "]
    turn = events[0].data["turn_id"]
    assert events[0].data["text"] == "/slow 3"
    assert all(e.data["turn_id"] == turn for e in events)
    assert events[-1].data == {"turn_id": turn, "stop_reason": "end_turn", "error": None}


def test_flood_while_detached_is_retained_and_handed_over_in_order(server: Server):
    """AC-EXECUTORS-SURVIVAL-001.5, AC-EXECUTORS-SURVIVAL-001.6: events produced while no stream is attached are kept (up
    to the default bound of 100, then the agent is paused) and handed over, in production order,
    exactly once. More in test_agentctl_retention.py."""
    n = 2000

    async def scenario() -> tuple[list[Event], dict[str, Any]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, f"/flood {n}")
            entry = await wait_instance(client, iid, lambda e: e["paused"], what="paused")
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            return events, entry

    events, entry = run(scenario())
    assert entry["attached"] is False and entry["retained_events"] == 100 and entry["current_turn_id"]
    assert chunks(events) == [f"{i}/{n} " for i in range(1, n + 1)]
    assert [e.seq for e in events] == list(range(1, n + 3))
    assert events[-1].data["stop_reason"] == "end_turn"


def test_detach_mid_stream_and_reattach_after_last_processed(server: Server):
    """AC-EXECUTORS-SURVIVAL-001.5: re-attaching with after_seq = last processed loses nothing and
    repeats nothing; one stream per instance (a new attach ends the previous one)."""
    n = 2000

    async def scenario() -> tuple[list[Event], list[Event], list[bool]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            first = await client.attach(iid, 0)
            turn = await client.prompt(iid, f"/flood {n}")
            part1 = await collect_until(first, lambda e: e.kind == "session_update" and len(chunks([e])) == 1
                                        and e.data["update"]["content"]["text"] == f"500/{n} ")
            attached = [(await client.list_instances())[0]["attached"]]
            # a second stream replaces the first one
            second = await client.attach(iid, part1[-1].seq)
            with pytest.raises((StopAsyncIteration, IpcError)):
                for _ in range(n + 10):  # the old stream may still deliver what was in flight
                    await asyncio.wait_for(first.__anext__(), STEP)
            await first.close()
            await second.close()

            async def detached() -> bool:
                return (await client.list_instances())[0]["attached"] is False

            await eventually(detached, STEP, message="no stream attached")
            attached.append((await client.list_instances())[0]["attached"])
            third = await client.attach(iid, part1[-1].seq)
            try:
                part2 = await collect_until(third, turn_ended(turn))
            finally:
                await third.close()
            return part1, part2, attached

    part1, part2, attached = run(scenario())
    assert attached == [True, False]
    assert part2[0].seq == part1[-1].seq + 1
    assert chunks(part1 + part2) == [f"{i}/{n} " for i in range(1, n + 1)]
    seqs = [e.seq for e in part1 + part2]
    assert seqs == sorted(set(seqs))


def test_turn_outcome_is_retained_until_acked_by_its_id(server: Server):
    """AC-EXECUTORS-SURVIVAL-004.1, AC-EXECUTORS-SURVIVAL-004.6: reading never discards; only an ack naming the turn id
    does; acking an unknown id succeeds and changes nothing."""

    async def scenario() -> None:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "hello")
            outcome = await wait_outcome(client, iid, turn)
            assert outcome == {"turn_id": turn, "stop_reason": "end_turn", "error": None}
            first = await client.turn_status(iid)
            assert first == {"current_turn_id": None, "outcomes": [outcome]}
            assert await client.turn_status(iid) == first  # repeatable
            assert (await client.ack_turn("unknown:1"))["acked"] is False
            assert await client.turn_status(iid) == first
            assert (await client.ack_turn(turn))["acked"] is True
            assert await client.turn_status(iid) == {"current_turn_id": None, "outcomes": []}
            assert (await client.ack_turn(turn))["acked"] is False  # a retried ack is harmless

    run(scenario())


def test_turn_ids_are_unique_and_prefixed_by_identity(server: Server):
    """AC-EXECUTORS-SURVIVAL-004.1: one turn id names one turn across all instances."""

    async def scenario() -> tuple[str, list[str]]:
        async with await server.connect() as client:
            a = (await server.create(client, session_id="a"))["instance_id"]
            b = (await server.create(client, session_id="b"))["instance_id"]
            turns = []
            for i in range(3):
                for iid in (a, b):
                    turn = await client.prompt(iid, f"hi {i}")
                    await wait_outcome(client, iid, turn)
                    turns.append(turn)
            return client.identity, turns

    identity, turns = run(scenario())
    assert len(set(turns)) == len(turns) == 6
    assert all(t.startswith(identity + ":") for t in turns)


def test_second_prompt_while_a_turn_is_open_is_a_conflict(server: Server):
    async def scenario() -> None:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/slow 2")
            with pytest.raises(IpcError) as info:
                await client.prompt(iid, "again")
            assert info.value.code == ErrorCode.CONFLICT
            assert (await client.turn_status(iid))["current_turn_id"] == turn
            await wait_outcome(client, iid, turn)

    run(scenario())


def test_cancel_ends_the_turn(server: Server):
    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            stream = await client.attach(iid, 0)
            try:
                turn = await client.prompt(iid, "/slow 30")
                await collect_until(stream, lambda e: e.kind == "session_update")
                await client.cancel(iid)
                return await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()

    events = run(scenario())
    assert events[-1].data["stop_reason"] == "cancelled"


def test_failed_prompt_ends_the_turn_with_error(server: Server):
    async def scenario() -> dict[str, Any]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/fail")
            return await wait_outcome(client, iid, turn)

    outcome = run(scenario())
    assert outcome["stop_reason"] == "error" and "mock /fail" in outcome["error"]


def test_permission_request_waits_for_the_backend(server: Server):
    """A permission request is an event and stays open until respond_permission (no auto-cancel)."""

    async def scenario() -> list[Event]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/permission")
            await asyncio.sleep(1.0)  # raised while detached: it must still be open afterwards
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, lambda e: e.kind == EventKind.PERMISSION_REQUEST)
                request = events[-1].data
                assert request["turn_id"] == turn
                assert [o["optionId"] for o in request["options"]] == ["allow", "reject"]
                assert request["tool_call"]["toolCallId"].startswith("mock-permission-")
                with pytest.raises(IpcError) as info:
                    await client.respond_permission(iid, request["request_id"], "maybe")
                assert info.value.code == ErrorCode.INVALID_ARGUMENT
                with pytest.raises(IpcError) as info:
                    await client.respond_permission(iid, "no-such-request", "allow")
                assert info.value.code == ErrorCode.NOT_FOUND
                await client.respond_permission(iid, request["request_id"], "allow")
                events += await collect_until(stream, turn_ended(turn))
                with pytest.raises(IpcError) as info:  # answered: no longer open
                    await client.respond_permission(iid, request["request_id"], "allow")
                assert info.value.code == ErrorCode.NOT_FOUND
                return events
            finally:
                await stream.close()

    events = run(scenario())
    assert chunks(events) == ["permission: allow"]
    assert events[-1].data["stop_reason"] == "end_turn"


def test_stop_instance_kills_the_whole_group_and_is_idempotent(server: Server):
    """docs/architecture.md#the-control-server-inside: stop kills the agent's process group (children included); absent = success."""
    spawner = (
        "import os, subprocess, sys\n"
        "subprocess.Popen(['sleep', '300'], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'daemon.agents.mock'])\n"
    )

    async def scenario() -> tuple[int, list[int]]:
        async with await server.connect() as client:
            created = await server.create(client, command=[sys.executable, "-c", spawner])
            iid, pid = created["instance_id"], created["pid"]
            children = [p.pid for p in psutil.Process(pid).children()]
            assert children and all(os.getpgid(c) == pid for c in children)
            started = time.monotonic()
            assert await client.stop_instance(iid) == {"stopped": True, "already_absent": False}
            assert time.monotonic() - started < 10
            assert await client.stop_instance(iid) == {"stopped": False, "already_absent": True}
            assert await client.list_instances() == []
            for op, args in [("prompt", {"text": "x"}), ("turn_status", {}), ("ack_events", {"seq": 0})]:
                with pytest.raises(IpcError) as info:
                    await client.call(op, {"instance_id": iid, **args})
                assert info.value.code == ErrorCode.NOT_FOUND, op
            with pytest.raises(IpcError) as info:
                await client.attach(iid, 0)
            assert info.value.code == ErrorCode.NOT_FOUND
            return pid, children

    pgid, children = run(scenario())
    wait_until(lambda: not group_exists(pgid), 10, message="agent group gone")
    # the group is gone: nothing of it runs; at most bwrap's init is left for init to reap
    wait_until(lambda: _killpg_refused(pgid), 30, message="group reaped")
    assert not any(psutil.pid_exists(c) and psutil.Process(c).status() != psutil.STATUS_ZOMBIE for c in children)


def test_agent_exit_mid_turn_is_reported(server: Server):
    """The exit of an agent is an event (exit code, stderr tail) and ends its open turn with
    agent_exited; the instance stays listed as exited until stopped."""

    async def scenario() -> tuple[list[Event], dict[str, Any], dict[str, Any]]:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/exit 5")
            outcome = await wait_outcome(client, iid, turn)
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            (entry,) = await client.list_instances()
            with pytest.raises(IpcError) as info:
                await client.prompt(iid, "again")
            assert info.value.code == ErrorCode.CONFLICT
            assert (await client.stop_instance(iid))["stopped"] is True
            return events, outcome, entry

    events, outcome, entry = run(scenario())
    kinds = [e.kind for e in events]
    assert kinds == ["turn_started", "session_update", "agent_exited", "turn_ended"]
    assert chunks(events) == ["exiting 5"]
    assert events[2].data["exit_code"] == 5
    assert "/exit: exiting 5" in events[2].data["stderr_tail"]
    assert outcome["stop_reason"] == "agent_exited"
    assert entry["state"] == "exited" and entry["exit_code"] == 5 and entry["current_turn_id"] is None


def test_ack_events_discards_and_checks_range(server: Server):
    async def scenario() -> None:
        async with await server.connect() as client:
            iid = (await server.create(client))["instance_id"]
            turn = await client.prompt(iid, "/flood 10")
            await wait_outcome(client, iid, turn)
            assert (await client.ack_events(iid, 5))["discarded"] == 5
            assert (await client.ack_events(iid, 5))["discarded"] == 0
            with pytest.raises(IpcError) as info:
                await client.ack_events(iid, 1000)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT
            with pytest.raises(IpcError) as info:
                await client.attach(iid, 1000)
            assert info.value.code == ErrorCode.INVALID_ARGUMENT
            stream = await client.attach(iid, 0)
            try:
                events = await collect_until(stream, turn_ended(turn))
            finally:
                await stream.close()
            assert events[0].seq == 6 and stream.result["instance_id"] == iid

    run(scenario())


def test_resume_loads_the_session_and_replays_history(server: Server):
    """create_instance with resume_session_id uses session/load; replayed updates belong to no turn."""

    async def scenario() -> tuple[str, str, list[Event]]:
        async with await server.connect() as client:
            first = await server.create(client)
            turn = await client.prompt(first["instance_id"], "remember me")
            await wait_outcome(client, first["instance_id"], turn)
            await client.stop_instance(first["instance_id"])
            second = await server.create(client, resume_session_id=first["acp_session_id"])
            stream = await client.attach(second["instance_id"], 0)
            try:
                events = await collect_until(stream, lambda e: "echo: remember me" in chunks([e]))
            finally:
                await stream.close()
            return first["acp_session_id"], second["acp_session_id"], events

    first_sid, second_sid, events = run(scenario())
    assert first_sid == second_sid
    assert all(e.data["turn_id"] is None for e in events)


def test_handshake_failures_are_agent_errors_and_leave_nothing(server: Server):
    """A failed initialize or session/load is a typed agent_error with the exit code and stderr
    tail; the group is killed and the instance is not listed."""

    async def scenario() -> tuple[IpcError, IpcError, IpcError]:
        async with await server.connect() as client:
            (server.workspace / ".kandev-mock.toml").write_text("fail_initialize = true\n")
            with pytest.raises(IpcError) as init:
                await server.create(client)
            (server.workspace / ".kandev-mock.toml").write_text("fail_load = true\n")
            with pytest.raises(IpcError) as load:
                await server.create(client, resume_session_id="0" * 32)
            (server.workspace / ".kandev-mock.toml").unlink()
            with pytest.raises(IpcError) as spawn:
                await server.create(client, command=["/nonexistent/agent"])
            assert await client.list_instances() == []
            return init.value, load.value, spawn.value

    init, load, spawn = run(scenario())
    assert init.code == ErrorCode.AGENT_ERROR and "initialize" in init.message and "exit code 3" in init.message
    assert "fail_initialize set" in init.message  # stderr tail
    assert load.code == ErrorCode.AGENT_ERROR and "session/load" in load.message
    assert spawn.code == ErrorCode.AGENT_ERROR and "/nonexistent/agent" in spawn.message
    for pid in list(server.agent_groups):
        wait_until(lambda pid=pid: not group_exists(pid), 10, message="failed agent's group gone")


# ---------------------------------------------------------------- robustness


def _raw(path: str, data: bytes, *, read: bool = True) -> dict[str, Any] | None:
    """Send raw bytes; return the first answer frame, or None if the server closed the connection."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(STEP)
    try:
        s.connect(path)
        s.sendall(data)
        if not read:
            return None
        body = read_frame_body(s)
        return None if body is None else msgpack.unpackb(body, raw=False)
    except (ConnectionResetError, BrokenPipeError):
        return None
    finally:
        s.close()


def _frame(obj: dict[str, Any]) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_bad_input_is_refused_and_the_server_keeps_serving(server: Server):
    """docs/architecture.md#the-ipc-protocol-ipc: garbage, oversized frames, unknown ops and missing fields get a typed error
    or a closed connection, never a crash or a stall."""
    cases = {
        "random bytes": (os.urandom(64), {ErrorCode.INVALID_FRAME, ErrorCode.FRAME_TOO_LARGE}),
        "100 MiB length prefix": (struct.pack(">I", 100 * 1024 * 1024) + b"x" * 16, {ErrorCode.FRAME_TOO_LARGE}),
        "not a map": (_frame_raw(msgpack.packb([1, 2, 3])), {ErrorCode.INVALID_FRAME}),
        "unknown op": (_frame({"v": 1, "id": 1, "op": "rm_rf", "args": {}}), {ErrorCode.UNKNOWN_OP}),
        "missing fields": (_frame({"v": 1, "id": 1, "op": "prove", "args": {}}), {ErrorCode.INVALID_ARGUMENT}),
        "wrong type": (
            _frame({"v": 1, "id": 1, "op": "prove", "args": {"challenge": "text"}}),
            {ErrorCode.INVALID_ARGUMENT},
        ),
        "wrong major": (_frame({"v": 2, "id": 1, "op": "identify", "args": {}}), {ErrorCode.INCOMPATIBLE_VERSION}),
    }
    for name, (payload, codes) in cases.items():
        reply = _raw(server.socket_path, payload)
        if reply is not None:
            assert reply["ok"] is False and reply["error"]["code"] in codes, (name, reply)
        assert run(identify(server.socket_path)) is not None, name
    # a peer that sends half a frame and hangs up
    _raw(server.socket_path, struct.pack(">I", 1000) + b"abc", read=False)

    async def authenticated_garbage() -> None:
        async with await server.connect() as client:
            with pytest.raises(IpcError) as info:
                await client.call("create_instance", {"session_id": "s"})
            assert info.value.code == ErrorCode.INVALID_ARGUMENT and "task_id" in info.value.message
            for bad in (
                {"command": []},
                {"command": ["x\0y"]},
                {"cwd": "relative/dir"},
                {"cwd": str(server.root / "missing")},
                {"env": {"A": 1}},
                {"env": {"A=B": "x"}},
            ):
                args = {"session_id": "s", "task_id": "t", "command": MOCK, "cwd": str(server.workspace), **bad}
                with pytest.raises(IpcError) as info:
                    await client.call("create_instance", args)
                assert info.value.code == ErrorCode.INVALID_ARGUMENT, bad
            with pytest.raises(IpcError) as info:
                await client.call("prompt", {"instance_id": "nope", "text": "x"})
            assert info.value.code == ErrorCode.NOT_FOUND
            assert await client.list_instances() == []

    run(authenticated_garbage())
    assert server.proc.poll() is None


def _frame_raw(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


@pytest.mark.parametrize("limit", [0, 10001, 2.5])
def test_out_of_range_retention_limit_refuses_to_start(short_tmp: Path, limit: Any):
    """AC-EXECUTORS-SURVIVAL-001.8: validated when the control server starts; rejected, not clamped;
    exit code 2, the message names key, value and range, and nothing is bound."""
    srv = write_launch(short_tmp, detached_event_limit=limit)
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.agentctl.main", "--launch-file", str(srv.launch_file)],
        cwd=REPO_ROOT,
        env=server_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "agentctl.detached_event_limit" in proc.stderr and str(limit) in proc.stderr, proc.stderr
    assert "1..10000" in proc.stderr
    assert not os.path.exists(srv.socket_path)
    assert "agentctl.detached_event_limit" in srv.log_path.read_text()  # logged, too


def test_bad_launch_file_or_credential_refuses_to_start(short_tmp: Path):
    srv = write_launch(short_tmp)
    os.chmod(srv.launch_file, 0o644)
    cmd = [sys.executable, "-m", "daemon.agentctl.main", "--launch-file", str(srv.launch_file)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "0600" in proc.stderr
    os.chmod(srv.launch_file, 0o600)
    os.chmod(srv.home / "agentctl" / "credential", 0o644)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "credential" in proc.stderr
    assert not os.path.exists(srv.socket_path)
    # --home finds <home>/agentctl/launch.json
    os.chmod(srv.home / "agentctl" / "credential", 0o600)
    srv.launch_file.rename(srv.home / "agentctl" / "other.json")
    proc = subprocess.run(
        [sys.executable, "-m", "daemon.agentctl.main", "--home", str(srv.home)],
        cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and str(srv.home / "agentctl" / "launch.json") in proc.stderr


def test_sigterm_stops_every_agent_group(server: Server):
    """SIGTERM to the control server: every agent group is killed, the socket removed, exit 0."""

    async def scenario() -> list[int]:
        async with await server.connect() as client:
            pids = [(await server.create(client, session_id=f"s{i}"))["pid"] for i in range(2)]
            await client.prompt((await client.list_instances())[0]["instance_id"], "/slow 30")
            return pids

    pids = run(scenario())
    assert all(group_exists(p) for p in pids)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(20) == 0
    for pid in pids:
        wait_until(lambda pid=pid: not group_exists(pid), 10, message=f"group {pid} gone")
    assert not os.path.exists(server.socket_path)
    assert "agentctl_stopped" in server.log_text()


def test_sigkill_of_the_server_takes_its_agents_along(server: Server):
    """PR_SET_PDEATHSIG=SIGKILL: an agent never outlives its control server."""

    async def scenario() -> int:
        async with await server.connect() as client:
            return (await server.create(client))["pid"]

    pid = run(scenario())
    server.proc.kill()
    server.proc.wait(10)
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
             10, message="agent died with its server")


def test_ownership_shutdown_stops_everything_and_exits(server: Server):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.9: stop every instance, reply, then exit."""

    async def scenario() -> tuple[dict[str, Any], list[str]]:
        async with await server.connect() as client:
            ids = [(await server.create(client, session_id=f"s{i}"))["instance_id"] for i in range(2)]
            return await client.ownership_shutdown(), ids

    reply, ids = run(scenario())
    assert sorted(reply["stopped"]) == sorted(ids)
    assert server.proc.wait(20) == 0
    for pgid in server.agent_groups:
        assert not group_exists(pgid)
    assert run(identify(server.socket_path, timeout=1.0)) is None


def test_survives_dead_stdio(short_tmp: Path):
    """AC-EXECUTORS-SURVIVAL-001.3: with stderr a pipe nobody reads any more, log writes never kill
    the server; its own file keeps the log."""
    srv = write_launch(short_tmp)
    try:
        start_server(srv, stderr=subprocess.PIPE)
        assert srv.proc is not None and srv.proc.stderr is not None
        srv.proc.stderr.close()  # the reader is gone: every stderr write now fails with EPIPE

        async def scenario() -> None:
            async with await srv.connect() as client:
                iid = (await srv.create(client))["instance_id"]
                for _ in range(3):
                    turn = await client.prompt(iid, "hello")
                    await wait_outcome(client, iid, turn)
                await client.stop_instance(iid)

        run(scenario())
        assert srv.proc.poll() is None
        assert run(identify(srv.socket_path)) is not None
        assert "instance_stopped" in srv.log_text()
    finally:
        stop_server(srv)


def test_socket_directory_is_private(server: Server):
    run_dir = Path(server.socket_path).parent
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    assert (os.stat(server.socket_path).st_mode & 0o777) == 0o600


def test_sighup_is_ignored(server: Server):
    """A detached server has no terminal; a hangup must not end it."""
    server.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)  # a window in which a hangup that ended the server would have done so
    assert server.proc.poll() is None
    assert run(identify(server.socket_path)) is not None


def test_sd_notify_ready_and_status(short_tmp: Path):
    """READY=1 once the socket is bound, STATUS= tracks the number of instances."""
    notify_path = short_tmp / "notify.sock"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(notify_path))
    sink.settimeout(STEP)
    srv = write_launch(short_tmp)
    messages: list[str] = []

    def receive_until(message: str, start: int = 0) -> int:
        """Read notifications until ``message`` arrives at index >= start; returns its index."""
        while True:
            for i in range(start, len(messages)):
                if messages[i] == message:
                    return i
            messages.extend(m for m in sink.recv(4096).decode().split("\n"))

    try:
        start_server(srv, env={"NOTIFY_SOCKET": str(notify_path)})
        ready = receive_until("READY=1")
        receive_until("STATUS=serving 0 instances", ready)

        async def scenario() -> None:
            async with await srv.connect() as client:
                iid = (await srv.create(client))["instance_id"]
                one = await asyncio.to_thread(receive_until, "STATUS=serving 1 instance")
                await client.stop_instance(iid)
                await asyncio.to_thread(receive_until, "STATUS=serving 0 instances", one)

        run(scenario())
    except TimeoutError as exc:
        raise AssertionError(f"missing notification; got {messages}") from exc
    finally:
        stop_server(srv)
        sink.close()
