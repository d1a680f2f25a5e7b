"""Ownership of a real ``kandev-agentctl`` process: rotation, single driver, unowned shutdown.

Every test starts its own control server (``python -m daemon.agentctl.main``, its own session)
on a private home and drives it through the real client (``daemon.agentctl.client.connection``) or raw
frames over its real socket; agents are the real mock agent. Every wait is bounded; teardown
SIGTERMs, then SIGKILLs, the servers and the agent process groups the test started. The pure
rules are in ``tests/unit/test_agentctl_ownership.py``; here is what crosses the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from daemon.agentctl import auth
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import OwnershipRefused, identify
from daemon.agentctl.protocol import TABLE, EventKind
from ipc.client import AsyncClient, EventStream
from ipc.errors import ErrorCode, IpcError
from ipc.framing import ConnectionClosed
from tests.support.agentctl import STEP, Server, start_server, stop_server, write_launch
from tests.support.aio import run
from tests.support.processes import group_exists
from tests.support.waiting import eventually, wait_until

pytestmark = pytest.mark.timeout(240)

PERIOD = 60.0  # the floor (AC-EXECUTORS-CONTROL-OWNERSHIP-003.7): the shortest period a server runs with
TIMER_SLACK = 6.0  # timer tick (1 s) + stopping a TERM-ignoring group (3 s grace) + process exit


# ---------------------------------------------------------------- helpers


def auth_ops(instance_id: str) -> dict[str, dict[str, Any]]:
    """Every op of the table that needs an authenticated connection, with well-formed args
    (taken from the table itself, so an op added later is covered too), plus ``rotate``."""
    samples: dict[type, Any] = {int: 1, list: ["x"], dict: {}, bytes: b"x" * 32, bool: True, float: 1.0}
    ops: dict[str, dict[str, Any]] = {}
    for name in TABLE.names:
        op = TABLE.get(name)
        if not op.auth:
            continue
        args: dict[str, Any] = {}
        for field, spec in op.required.items():
            kind = spec[0] if isinstance(spec, tuple) else spec
            args[field] = (instance_id if field == "instance_id" else "/tmp") if kind is str else samples[kind]
        ops[name] = args
    ops["rotate"] = {}
    # ownership_shutdown last: if a refusal were missing, it would be the one to end the server.
    ops["ownership_shutdown"] = ops.pop("ownership_shutdown")
    return ops


async def expect(code: str, call: Awaitable[Any]) -> IpcError:
    with pytest.raises(IpcError) as info:
        await call
    assert info.value.code == code, info.value
    return info.value


async def raw_connection(srv: Server) -> tuple[AsyncClient, str]:
    conn = await AsyncClient.connect(srv.socket_path, hello=False, timeout=STEP)
    identity = (await conn.call("identify", timeout=STEP))["server_identity"]
    return conn, identity


async def raw_auth(conn: AsyncClient, identity: str, credential: bytes) -> dict[str, Any]:
    nonce = (await conn.call("auth_begin", timeout=STEP))["nonce"]
    return await conn.call("auth_finish", {"proof": auth.connection_proof(credential, nonce, identity)}, timeout=STEP)


async def wait_closed(client: AgentctlClient | AsyncClient, what: str) -> None:
    await eventually(lambda: client.closed, STEP, message=f"{what} closed")


async def drain(stream: EventStream, seen: list[Any]) -> str:
    """Read a stream to its end; returns how it ended."""
    try:
        async for event in stream:
            seen.append(event)
    except (ConnectionClosed, IpcError) as exc:
        return f"closed: {exc}"
    return "ended"


def term_ignoring_agent() -> list[str]:
    """The mock agent ignoring TERM itself (a stubborn agent): stopping its group then takes the 3 s
    grace and a SIGKILL, which holds the server in its shutdown long enough to be observed. (A
    TERM-ignoring child of a mock that dies on TERM no longer does: in its sandbox, the agent's exit
    ends the pid namespace and every process in it at once.)"""
    return ["/bin/sh", "-c", f"trap '' TERM; exec {shlex.quote(sys.executable)} -m daemon.agents.mock"]


# ---------------------------------------------------------------- rotation


def test_rotation_ids_increase_replay_returns_the_same_pair_and_a_third_credential_is_dead(server: Server):
    """Rotation ids strictly increase (AC-EXECUTORS-CONTROL-OWNERSHIP-002.6); a retry with the superseded
    credential returns the same id and credential (AC-EXECUTORS-CONTROL-OWNERSHIP-002.10); at most two credentials are
    acceptable, every other one authenticates nothing and its connections are closed
    (AC-EXECUTORS-CONTROL-OWNERSHIP-002.8)."""

    async def scenario() -> None:
        first = await server.connect(purpose="adopt")  # the launch credential C0, confirmed(0)
        assert first.credential_role == "current"
        rotation_id, c1 = await first.rotate()
        assert rotation_id == 1 and len(c1) == auth.CREDENTIAL_BYTES and c1 != server.credential
        assert await first.rotate() == (1, c1)  # same connection, C0 now superseded: the replay
        retry = await server.connect(purpose="adopt")  # a backend that lost the answer retries
        assert retry.credential_role == "superseded"
        for _ in range(3):
            assert await retry.rotate() == (1, c1)
        assert (await retry.call("rotate"))["replay"] is True
        # Superseded is not enough to drive: a plain connect refuses it.
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, server.connect())

        second = await server.connect(credential=c1)
        assert second.credential_role == "current"
        rotation_id2, c2 = await second.rotate()
        assert rotation_id2 == 2 and c2 not in (c1, server.credential)
        # C0 authenticates nothing now: its open connections are closed, a new one is refused.
        await wait_closed(first, "connection under C0")
        await wait_closed(retry, "second connection under C0")
        with pytest.raises(OwnershipRefused) as info:
            await server.connect(purpose="adopt")
        assert info.value.reason == "authentication_failure"
        # c1 (superseded by rotation 2) only adopts; c2 drives; the server proves exactly two.
        assert (await server.connect(credential=c1, purpose="adopt")).credential_role == "superseded"
        third = await server.connect(credential=c2)
        assert await third.list_instances() == []
        conn, _ = await raw_connection(server)
        proofs = (await conn.call("prove", {"challenge": auth.new_challenge()}))["proofs"]
        assert len(proofs) == 2
        await conn.close()
        for client in (second, third):
            await client.close()

    run(scenario())
    assert "ownership_rotated" in server.log_text()


def test_rotate_with_its_own_proof_and_refusals(server: Server):
    """``rotate {proof}``: a connection may prove possession for the rotation itself (over its pending
    auth_begin nonce), so the credential never crosses the socket; a wrong proof leaves the connection
    unauthenticated. AC-EXECUTORS-CONTROL-OWNERSHIP-002.10 holds on this path too."""

    async def scenario() -> None:
        conn, identity = await raw_connection(server)
        await expect(ErrorCode.UNAUTHENTICATED, conn.call("rotate"))
        await expect(ErrorCode.UNAUTHENTICATED, conn.call("rotate", {"proof": b"x" * 32}))  # no nonce
        nonce = (await conn.call("auth_begin"))["nonce"]
        wrong = auth.connection_proof(auth.new_credential(), nonce, identity)
        await expect(ErrorCode.UNAUTHENTICATED, conn.call("rotate", {"proof": wrong}))
        await expect(ErrorCode.UNAUTHENTICATED, conn.call("list_instances"))
        nonce = (await conn.call("auth_begin"))["nonce"]
        answer = await conn.call("rotate", {"proof": auth.connection_proof(server.credential, nonce, identity)})
        assert answer["rotation_id"] == 1 and answer["replay"] is False
        other, _ = await raw_connection(server)
        nonce = (await other.call("auth_begin"))["nonce"]
        again = await other.call("rotate", {"proof": auth.connection_proof(server.credential, nonce, identity)})
        assert (again["rotation_id"], again["credential"], again["replay"]) == (1, answer["credential"], True)
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, other.call("list_instances"))
        for c in (conn, other):
            await c.close()

    run(scenario())


def test_scenario_b_after_confirm_the_old_credential_is_refused_and_its_stream_closed(server: Server):
    """Issue 3 scenario B. After the confirmation every operation with the superseded credential is
    refused (AC-EXECUTORS-CONTROL-OWNERSHIP-002.1) and its open event stream is terminated
    (AC-EXECUTORS-CONTROL-OWNERSHIP-002.2); in phase 1 it already drives nothing and opens no stream, while
    the new owner is served (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7)."""

    async def scenario() -> None:
        old = await server.connect()  # backend A, holding C0
        instance_id = (await server.create(old))["instance_id"]
        stream = await old.attach(instance_id)
        turn_id = await old.prompt(instance_id, "/slow 30")
        old_events: list[Any] = []
        old_reader = asyncio.ensure_future(drain(stream, old_events))

        def streaming() -> bool:
            assert not old_reader.done(), old_events
            return any(e.kind == EventKind.SESSION_UPDATE for e in old_events)

        await eventually(streaming, STEP, message="a session update on A's stream")

        new = await server.connect(purpose="adopt")  # backend B, with the stored C0
        rotation_id, c1 = await new.rotate()

        # Phase 1: C0 is superseded. It drives nothing and opens no stream.
        for op, args in auth_ops(instance_id).items():
            if op in ("rotate", "ownership_shutdown"):
                continue
            await expect(ErrorCode.SUPERSEDED_CREDENTIAL, old.call(op, args))
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, old.attach(instance_id))
        assert not old_reader.done()  # the stream opened earlier runs until the confirmation

        # B stores c1 durably (here: nothing to store), authenticates with it, confirms.
        assert await new.reauthenticate(c1) == "current"
        assert await new.confirm_rotation(rotation_id) == {"rotation_id": rotation_id, "changed": True}

        # Phase 2: A's stream and connection are cut at once, mid-turn.
        ended = await asyncio.wait_for(old_reader, STEP)
        assert ended.startswith(("closed", "ended")), ended
        await wait_closed(old, "A's connection")
        seen_by_a = len(old_events)
        # C0 now authenticates nothing: the server proves only c1, and every operation is refused.
        with pytest.raises(OwnershipRefused) as info:
            await server.connect(purpose="adopt")
        assert info.value.reason == "authentication_failure"
        conn, identity = await raw_connection(server)
        await expect(ErrorCode.UNAUTHENTICATED, raw_auth(conn, identity, server.credential))
        for op, args in auth_ops(instance_id).items():
            await expect(ErrorCode.UNAUTHENTICATED, conn.call(op, args))
        nonce = (await conn.call("auth_begin"))["nonce"]
        proof = auth.connection_proof(server.credential, nonce, identity)
        await expect(ErrorCode.UNAUTHENTICATED, conn.call("rotate", {"proof": proof}))
        await conn.close()

        # B drives: the turn goes on and B's stream gets what A did not process.
        assert [i["instance_id"] for i in await new.list_instances()] == [instance_id]
        b_stream = await new.attach(instance_id, after_seq=old_events[-1].seq if old_events else 0)
        b_events: list[Any] = []

        async def until_end() -> None:
            async for event in b_stream:
                b_events.append(event)
                if event.kind == EventKind.TURN_ENDED and event.data["turn_id"] == turn_id:
                    return

        await asyncio.wait_for(until_end(), 60)
        assert len(old_events) == seen_by_a  # nothing more reached A after the cut
        await b_stream.close()
        await new.close()

    run(scenario(), timeout=150)
    assert "ownership_confirmed" in server.log_text()


def test_confirmations_earlier_repeated_and_unknown(server: Server):
    """AC-EXECUTORS-CONTROL-OWNERSHIP-002.6: confirming an earlier id is accepted and changes nothing
    (it never revokes a newer credential), a repeated confirmation has no effect after the first, an id
    never issued is refused with unknown_rotation and nothing changes; the confirmation is sent with
    the new credential."""

    async def scenario() -> None:
        a = await server.connect(purpose="adopt")
        _, c1 = await a.rotate()
        b = await server.connect(credential=c1)
        _, c2 = await b.rotate()
        # b's connection is under c1, now superseded: it may not confirm.
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, b.confirm_rotation(2))
        assert await b.reauthenticate(c2) == "current"
        error = await expect(ErrorCode.UNKNOWN_ROTATION, b.confirm_rotation(3))
        assert "never issued" in error.message
        await expect(ErrorCode.INVALID_ARGUMENT, b.call("confirm_rotation", {"rotation_id": "2"}))
        # Nothing changed: c1 still replays rotation 2.
        probe = await server.connect(credential=c1, purpose="adopt")
        assert await probe.rotate() == (2, c2)
        assert await b.confirm_rotation(1) == {"rotation_id": 1, "changed": False}
        assert (await server.connect(credential=c1, purpose="adopt")).credential_role == "superseded"
        assert await b.confirm_rotation(2) == {"rotation_id": 2, "changed": True}
        await wait_closed(probe, "the connection under c1")
        for k in (2, 1, 0):
            assert await b.confirm_rotation(k) == {"rotation_id": k, "changed": False}
        assert await b.list_instances() == []
        with pytest.raises(OwnershipRefused):
            await server.connect(credential=c1, purpose="adopt")
        await b.close()

    run(scenario())


def test_superseded_credential_shuts_down_but_never_drives(server: Server):
    """The superseded credential authenticates only another adoption or the ownership
    shutdown (AC-EXECUTORS-CONTROL-OWNERSHIP-002.7); ownership_shutdown with it, and no adoption, stops every
    instance and exits, and a second call while stopping succeeds too
    (AC-EXECUTORS-CONTROL-OWNERSHIP-002.9)."""

    async def scenario() -> tuple[list[Any], list[str]]:
        owner = await server.connect()
        ids = [(await server.create(owner, session_id=f"s{i}"))["instance_id"] for i in range(2)]
        crashed = await server.connect(purpose="adopt")
        await crashed.rotate()  # a backend that rotated, then died before confirming
        await crashed.close()
        stale = await server.connect(purpose="adopt")
        assert stale.credential_role == "superseded"
        for op, args in auth_ops(ids[0]).items():
            if op in ("rotate", "ownership_shutdown"):
                continue
            await expect(ErrorCode.SUPERSEDED_CREDENTIAL, stale.call(op, args))
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, stale.attach(ids[0]))
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, stale.claim())
        await expect(ErrorCode.SUPERSEDED_CREDENTIAL, owner.list_instances())  # C0 no longer drives
        assert all(group_exists(pgid) for pgid in server.agent_groups)  # nothing was touched
        other = await server.connect(purpose="adopt")
        replies = await asyncio.gather(stale.ownership_shutdown(), other.ownership_shutdown())
        return list(replies), ids

    replies, ids = run(scenario())
    for reply in replies:
        assert sorted(reply["stopped"]) == sorted(ids)
    assert server.proc.wait(STEP) == 0
    for pgid in server.agent_groups:
        assert not group_exists(pgid)


# ---------------------------------------------------------------- Issue 3 scenario G: a peer that is not the owner


def _other_uid_probe(path: str) -> str:
    code = (
        "import socket\n"
        "s=socket.socket(socket.AF_UNIX)\n"
        f"s.connect({path!r})\n"
        "s.settimeout(10)\n"
        "try:\n"
        "    d=s.recv(4096)\n"
        "    s.sendall(b'\\x00\\x00\\x00\\x05\\x81\\xa2id\\x01\\x00')\n"
        "    d+=s.recv(4096)\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    d=b''\n"
        "print('closed' if not d else ('permission_denied' if b'permission_denied' in d else 'answered'))\n"
    )
    probe = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=30,
    )
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip()


def test_scenario_g_intruders_get_typed_refusals_while_the_owner_is_served(server: Server):
    """Issue 3 scenario G (AC-EXECUTORS-CONTROL-OWNERSHIP-001.2, AC-EXECUTORS-CONTROL-OWNERSHIP-001.10). A peer
    with a wrong credential, a proof replayed from another connection's nonce, or another uid
    gets a typed refusal for every authenticated operation (rotate and ownership_shutdown
    included), and the owner keeps being served."""

    async def scenario() -> None:
        owner = await server.connect()
        instance_id = (await server.create(owner))["instance_id"]
        owner_conn, identity = await raw_connection(server)
        nonce_o = (await owner_conn.call("auth_begin"))["nonce"]
        proof_o = auth.connection_proof(server.credential, nonce_o, identity)
        await owner_conn.call("auth_finish", {"proof": proof_o})

        # A wrong credential: the server's proof does not verify, auth fails, everything is refused.
        with pytest.raises(OwnershipRefused):
            await server.connect(credential=auth.new_credential())
        wrong, _ = await raw_connection(server)
        await expect(ErrorCode.UNAUTHENTICATED, raw_auth(wrong, identity, auth.new_credential()))
        # A replayed proof: without a nonce, over its own nonce, and as a rotate proof.
        replay, _ = await raw_connection(server)
        await expect(ErrorCode.UNAUTHENTICATED, replay.call("auth_finish", {"proof": proof_o}))
        await replay.call("auth_begin")
        await expect(ErrorCode.UNAUTHENTICATED, replay.call("auth_finish", {"proof": proof_o}))
        await replay.call("auth_begin")
        await expect(ErrorCode.UNAUTHENTICATED, replay.call("rotate", {"proof": proof_o}))
        for intruder in (wrong, replay):
            for op, args in auth_ops(instance_id).items():
                await expect(ErrorCode.UNAUTHENTICATED, intruder.call(op, args))
                assert (await owner.claim())["unowned_period_s"] == 600.0  # served in between
            assert [i["instance_id"] for i in await owner.list_instances()] == [instance_id]
        assert (await owner_conn.call("list_instances"))["instances"][0]["instance_id"] == instance_id
        turn = await owner.prompt(instance_id, "hello")

        async def ended() -> bool:
            return any(o["turn_id"] == turn for o in (await owner.turn_status(instance_id))["outcomes"])

        await eventually(ended, STEP, message=f"the outcome of turn {turn}")
        for c in (wrong, replay, owner_conn):
            await c.close()
        await owner.close()

    run(scenario())
    # Another uid: reachable on purpose (modes opened), refused by SO_PEERCRED before any frame.
    if os.geteuid() != 0:
        pytest.skip("the other-uid part needs root to run a probe as uid 65534 (the rest passed)")
    sock = Path(server.socket_path)
    opened = [server.root, server.home, sock.parent]
    modes = {p: p.stat().st_mode & 0o777 for p in (*opened, sock)}
    try:
        for p in opened:
            os.chmod(p, 0o755)
        os.chmod(sock, 0o666)
        assert _other_uid_probe(str(sock)) in ("permission_denied", "closed")
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)

    async def still_served() -> None:
        async with await server.connect() as owner:
            assert len(await owner.list_instances()) == 1
            await owner.claim()

    run(still_served())


# ---------------------------------------------------------------- the unowned period


@pytest.mark.parametrize(
    ("period", "idle", "resolved", "adjusted"),
    [
        (600, 0, 600.0, False),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.6: reaping off, period unchanged
        (600, 300, 150.0, True),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.4: half the idle timeout, logged
        (10, 0, 60.0, True),  # AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: raised to the 1 min floor, logged
    ],
)
def test_resolved_period_is_reported_and_adjustments_are_logged(short_tmp: Path, period, idle, resolved,
                                                                adjusted):
    srv = write_launch(short_tmp, unowned_period_s=period, idle_timeout_s=idle)
    try:
        start_server(srv)
        info = run(identify(srv.socket_path))
        assert info is not None and info["unowned_period_s"] == resolved
        assert set(info) == {"server_identity", "capabilities", "protocol_version", "unowned_period_s"}
        log = srv.log_text()
        assert ("unowned_period_adjusted" in log) is adjusted
    finally:
        stop_server(srv)


def test_scenario_d_unowned_shutdown_and_renewal(short_tmp: Path):
    """Issue 3 scenario D. Four servers, unowned period 60 s (the floor), idle reaping off, side by side:

    - A: bootstrapped, then rotated and confirmed at +20 s; afterwards only instance operations,
      enumeration and an open event stream (mid-turn).
      AC-EXECUTORS-CONTROL-OWNERSHIP-003.1: one period after the rotation it stops every agent
      group and exits 0. AC-EXECUTORS-CONTROL-OWNERSHIP-003.8: the rotation renewed, the
      operations and the stream did not. AC-EXECUTORS-CONTROL-OWNERSHIP-003.9: once decided,
      claim, rotate and confirm are refused with shutting_down, and ownership_shutdown still
      succeeds ("already stopping").
    - B: claims every 15 s (period/4) with an instance running.
      AC-EXECUTORS-CONTROL-OWNERSHIP-003.2: still owned and serving past 1.5 periods (several
      periods, with lost renewals, are proven on a fake clock in the unit tests).
    - C: spawned, never handshaken. AC-EXECUTORS-CONTROL-OWNERSHIP-003.8: expires one period
      after process start.
    - E: its first (bootstrap) handshake at +20 s and nothing else.
      AC-EXECUTORS-CONTROL-OWNERSHIP-003.8: the bootstrap renewed.
    """
    names = ("c", "e", "a", "b")
    servers: dict[str, Server] = {}
    popen_at: dict[str, float] = {}
    try:
        for name in names:
            (short_tmp / name).mkdir()
            servers[name] = write_launch(short_tmp / name, unowned_period_s=PERIOD, idle_timeout_s=0)
            popen_at[name] = time.monotonic()
            start_server(servers[name])
        a, b, c, e = (servers[n] for n in ("a", "b", "c", "e"))
        exited_at: dict[str, float] = {}

        async def watch_exits() -> None:
            while len(exited_at) < 3:
                for name in ("a", "c", "e"):
                    if name not in exited_at and servers[name].proc.poll() is not None:
                        exited_at[name] = time.monotonic()
                await asyncio.sleep(0.05)

        async def scenario() -> dict[str, Any]:
            facts: dict[str, Any] = {}
            watcher = asyncio.ensure_future(watch_exits())
            t0 = time.monotonic()
            client_a = await a.connect()  # A's bootstrap
            plain = (await a.create(client_a, session_id="a1"))["instance_id"]
            await a.create(client_a, session_id="a2", command=term_ignoring_agent())
            stream = await client_a.attach(plain)
            await client_a.prompt(plain, "/slow 200")  # mid-turn the whole time
            events: list[Any] = []
            reader = asyncio.ensure_future(drain(stream, events))

            client_b = await b.connect()
            b_instance = await b.create(client_b, session_id="b1")
            facts["b_instance"] = b_instance["instance_id"]
            claims: list[float] = []

            async def claim_loop() -> None:
                while True:
                    await client_b.claim()
                    claims.append(time.monotonic())
                    await asyncio.sleep(PERIOD / 4)

            claimer = asyncio.ensure_future(claim_loop())

            await asyncio.sleep(max(0.0, t0 + 20 - time.monotonic()))
            facts["rotate_before"] = time.monotonic()
            rotation_id, c1 = await client_a.rotate()
            facts["rotate_after"] = time.monotonic()
            await client_a.reauthenticate(c1)
            await client_a.confirm_rotation(rotation_id)
            await asyncio.wait_for(reader, STEP)  # the stream under the launch credential was cut
            stream = await client_a.attach(plain, after_seq=events[-1].seq if events else 0)
            reader = asyncio.ensure_future(drain(stream, events))

            facts["bootstrap_e_before"] = time.monotonic()
            client_e = await e.connect()
            await client_e.close()

            # A: instance operations, enumeration and the stream go on until the decision is logged.
            last_op = 0.0
            while "unowned_shutdown" not in a.log_text():
                assert time.monotonic() < facts["rotate_after"] + PERIOD + TIMER_SLACK, "A never expired"
                if time.monotonic() - last_op >= 1.0:
                    with contextlib.suppress(IpcError):
                        await client_a.list_instances()
                        await client_a.turn_status(plain)
                        last_op = time.monotonic()
                await asyncio.sleep(0.1)
            facts["decided_by"] = time.monotonic()
            facts["last_op"] = last_op
            facts["events_before_decision"] = len(events)
            # The one-way door, while A is still stopping its TERM-ignoring group.
            await expect(ErrorCode.SHUTTING_DOWN, client_a.claim())
            await expect(ErrorCode.SHUTTING_DOWN, client_a.rotate())
            await expect(ErrorCode.SHUTTING_DOWN, client_a.confirm_rotation(rotation_id))
            await expect(ErrorCode.SHUTTING_DOWN,
                         client_a.create_instance(session_id="x", task_id="x", command=["true"], cwd="/"))
            facts["already_stopping"] = await client_a.ownership_shutdown()

            await asyncio.wait_for(watcher, PERIOD + TIMER_SLACK * 2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(reader, STEP)

            # B, owned by its claims, is alive past 1.5 periods after its last non-claim renewal.
            await asyncio.sleep(max(0.0, t0 + 1.5 * PERIOD + 5 - time.monotonic()))
            facts["b_checked"] = time.monotonic() - t0
            assert b.proc.poll() is None, "B exited although it was claimed"
            assert [i["instance_id"] for i in await client_b.list_instances()] == [b_instance["instance_id"]]
            assert group_exists(b_instance["pid"])
            claimer.cancel()
            facts["claims"] = claims
            facts["b_stopped"] = await client_b.ownership_shutdown()
            return facts

        facts = run(scenario(), timeout=200)

        # A: expired one period after the rotation, not before; the operations did not renew.
        assert facts["decided_by"] >= facts["rotate_before"] + PERIOD
        assert facts["decided_by"] <= facts["rotate_after"] + PERIOD + TIMER_SLACK
        assert facts["decided_by"] - facts["last_op"] < 2.0  # busy with instance ops until the end
        assert isinstance(facts["already_stopping"]["stopped"], list)  # already stopping: success
        assert a.proc.wait(STEP) == 0
        assert exited_at["a"] <= facts["rotate_after"] + PERIOD + TIMER_SLACK
        for pgid in a.agent_groups:
            wait_until(lambda pgid=pgid: not group_exists(pgid), 10, message=f"A's agent group {pgid} gone")
        log_a = a.log_text()
        assert "unowned_shutdown" in log_a and "reason=unowned_shutdown" in log_a

        # C: never handshaken, expired one period after it started.
        assert c.proc.returncode == 0
        assert popen_at["c"] + PERIOD <= exited_at["c"] <= popen_at["c"] + PERIOD + TIMER_SLACK + 5
        assert "unowned_shutdown" in c.log_text()

        # E: the bootstrap at +20 s renewed, so it outlived its process start + period.
        assert e.proc.returncode == 0
        assert exited_at["e"] >= facts["bootstrap_e_before"] + PERIOD
        assert exited_at["e"] >= popen_at["e"] + PERIOD + 15

        # B: every claim succeeded, at period/4, and it was still serving past 1.5 periods.
        assert facts["b_checked"] >= 1.5 * PERIOD
        gaps = [y - x for x, y in itertools.pairwise(facts["claims"])]
        assert gaps and max(gaps) < PERIOD / 3
        assert facts["b_stopped"]["stopped"] == [facts["b_instance"]]
        assert b.proc.wait(STEP) == 0
    finally:
        for srv in servers.values():
            stop_server(srv)

