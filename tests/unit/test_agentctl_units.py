"""Pure logic of the control server: proofs, the launch file, the event log, the instance state machine."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

import msgpack
import pytest

from daemon.agentctl import auth, launch
from daemon.agentctl.instance.conversation import TurnIds
from daemon.agentctl.instance.events import MAX_EVENT_BYTES, EventLog, plain, sendable
from daemon.agentctl.instance.instance import InstanceState, can_transition
from daemon.agentctl.instance.process import INHERITED_ENV, agent_environment
from daemon.agentctl.launch import LaunchConfig, LaunchError
from daemon.agents.settings import AGENT_PATH
from daemon.config.keys import ConfigError
from tests.support.aio import run

CRED = bytes(range(32))


# ---------------------------------------------------------------- auth


def test_server_proof_is_the_documented_hmac():
    """docs/architecture.md#ownership: HMAC-SHA256(cred, "kandev-prove\\0" || challenge || identity || "\\0" || installation)."""
    challenge = b"c" * 32
    expected = hmac.new(CRED, b"kandev-prove\0" + challenge + b"ident" + b"\0" + b"inst", hashlib.sha256).digest()
    assert auth.server_proof(CRED, challenge, "ident", "inst") == expected


def test_connection_proof_is_the_documented_hmac():
    nonce = b"n" * 32
    expected = hmac.new(CRED, b"kandev-auth\0" + nonce + b"ident", hashlib.sha256).digest()
    assert auth.connection_proof(CRED, nonce, "ident") == expected


def test_proofs_bind_every_input_and_are_domain_separated():
    """AC-EXECUTORS-CONTROL-OWNERSHIP-001.10: a proof depends on credential, challenge, identity, installation."""
    base = auth.server_proof(CRED, b"a" * 32, "id", "inst")
    assert base != auth.server_proof(bytes(32), b"a" * 32, "id", "inst")
    assert base != auth.server_proof(CRED, b"b" * 32, "id", "inst")
    assert base != auth.server_proof(CRED, b"a" * 32, "id2", "inst")
    assert base != auth.server_proof(CRED, b"a" * 32, "id", "inst2")
    # identity/installation boundary cannot be shifted
    assert auth.server_proof(CRED, b"a" * 32, "ab", "c") != auth.server_proof(CRED, b"a" * 32, "a", "bc")
    # a server proof is never a valid connection proof for the same bytes
    assert auth.connection_proof(CRED, b"a" * 32, "id") != base


def test_verify_is_strict():
    proof = auth.connection_proof(CRED, b"n" * 32, "id")
    assert auth.verify(proof, proof)
    assert auth.verify(proof, bytearray(proof))
    assert not auth.verify(proof, proof[:-1] + bytes([proof[-1] ^ 1]))
    assert not auth.verify(proof, proof.hex())
    assert not auth.verify(proof, None)
    assert not auth.verify(proof, b"")


def test_fresh_credentials_and_challenges():
    assert len(auth.new_credential()) == auth.CREDENTIAL_BYTES == 32
    assert len(auth.new_challenge()) == auth.CHALLENGE_BYTES == 32
    assert auth.new_challenge() != auth.new_challenge()
    with pytest.raises(ValueError):
        auth.server_proof(b"", b"c" * 32, "i", "j")


# ---------------------------------------------------------------- launch file


def _private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    return d


def _config(d: Path, **kw: object) -> LaunchConfig:
    values: dict[str, object] = {
        "socket_path": str(d / "a.sock"),
        "log_path": str(d / "agentctl.log"),
        "agent_log_dir": str(d / "agents"),
        "installation_id": "0" * 32,
        "credential_file": str(d / "cred"),
    }
    values.update(kw)
    return LaunchConfig(**values)  # type: ignore[arg-type]


def test_launch_file_round_trip_is_0600(tmp_path):
    d = _private_dir(tmp_path)
    cfg = _config(d, detached_event_limit=250, mode="detached")
    path = d / "launch.json"
    launch.dump(cfg, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert launch.load(path) == cfg
    assert set(json.loads(path.read_text())) == {
        "socket_path", "log_path", "agent_log_dir", "installation_id", "credential_file",
        "detached_event_limit", "unowned_period_s", "idle_timeout_s", "mode", "agent_secret_env",
    }


def test_launch_file_refuses_wide_modes_and_symlinks(tmp_path):
    d = _private_dir(tmp_path)
    path = d / "launch.json"
    launch.dump(_config(d), path)
    os.chmod(path, 0o644)
    with pytest.raises(LaunchError, match="0600"):
        launch.load(path)
    os.chmod(path, 0o600)
    link = d / "link.json"
    link.symlink_to(path)
    with pytest.raises(LaunchError, match="symlink"):
        launch.load(link)
    with pytest.raises(LaunchError, match="does not exist"):
        launch.load(d / "missing.json")


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ([], "one JSON object"),
        ({"log_path": "l", "agent_log_dir": "a", "installation_id": "i"}, "socket_path"),
        ({"socket_path": "s", "log_path": "l", "agent_log_dir": "a", "installation_id": 3}, "installation_id"),
        ({"socket_path": "s", "log_path": "l", "agent_log_dir": "a", "installation_id": "i", "mode": "x"}, "mode"),
        (
            {"socket_path": "s", "log_path": "l", "agent_log_dir": "a", "installation_id": "i",
             "detached_event_limit": True},
            "detached_event_limit",
        ),
    ],
)
def test_launch_file_structure_is_checked(doc, fragment):
    with pytest.raises(LaunchError, match=fragment):
        launch.from_json(doc)


@pytest.mark.parametrize("limit", [0, 10001, -1, 2.5, "many"])
def test_retention_limit_out_of_range_is_refused_not_clamped(tmp_path, limit):
    """AC-EXECUTORS-SURVIVAL-001.8: only whole numbers 1..10000; the error names key, value, range."""
    cfg = _config(_private_dir(tmp_path), detached_event_limit=limit)
    with pytest.raises(ConfigError) as info:
        launch.validate(cfg)
    text = str(info.value)
    assert "agentctl.detached_event_limit" in text
    assert str(limit) in text
    if limit in (0, 10001, -1):
        assert "1..10000" in text


@pytest.mark.parametrize("limit", [1, 100, 10000])
def test_retention_limit_bounds_are_inclusive(tmp_path, limit):
    resolved = launch.validate(_config(_private_dir(tmp_path), detached_event_limit=limit))
    assert resolved.detached_event_limit == limit


def test_default_launch_file_is_under_the_home(tmp_path):
    assert launch.default_launch_file(tmp_path) == tmp_path / "agentctl" / "launch.json"


def test_credential_file_round_trip_and_refusals(tmp_path):
    d = _private_dir(tmp_path)
    path = d / "cred"
    launch.write_credential(path, CRED)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert launch.read_credential(_config(d), env={}) == CRED
    os.chmod(path, 0o640)
    with pytest.raises(LaunchError, match="0600"):
        launch.read_credential(_config(d), env={})
    os.chmod(path, 0o600)
    link = d / "cred-link"
    link.symlink_to(path)
    with pytest.raises(LaunchError, match="symlink"):
        launch.read_credential(_config(d, credential_file=str(link)), env={})
    bad = d / "bad"
    bad.write_bytes(b"zz" * 32)
    os.chmod(bad, 0o600)
    with pytest.raises(LaunchError, match="malformed") as info:
        launch.read_credential(_config(d, credential_file=str(bad)), env={})
    assert "zz" not in str(info.value)  # never echo the content
    with pytest.raises(LaunchError, match="no credential"):
        launch.read_credential(_config(d, credential_file=None), env={})
    with pytest.raises(ValueError):
        launch.encode_credential(b"short")


def test_systemd_credential_wins_over_the_file(tmp_path):
    d = _private_dir(tmp_path)
    launch.write_credential(d / "cred", CRED)
    creds_dir = d / "creds"
    creds_dir.mkdir()
    other = bytes(32)
    (creds_dir / launch.CREDENTIAL_NAME).write_bytes(launch.encode_credential(other))
    os.chmod(creds_dir / launch.CREDENTIAL_NAME, 0o400)  # as systemd makes it
    env = {"CREDENTIALS_DIRECTORY": str(creds_dir)}
    assert launch.read_credential(_config(d), env=env) == other
    # a credentials directory without ours falls back to credential_file
    (creds_dir / launch.CREDENTIAL_NAME).unlink()
    assert launch.read_credential(_config(d), env=env) == CRED
    (creds_dir / launch.CREDENTIAL_NAME).symlink_to(d / "cred")
    with pytest.raises(LaunchError, match="symlink"):
        launch.read_credential(_config(d), env=env)


# ---------------------------------------------------------------- event log


def test_event_log_numbers_and_retains_in_order():
    log = EventLog()
    for i in range(5):
        assert log.append("k", {"i": i}).seq == i + 1
    assert (log.first_seq, log.last_seq, log.next_seq, log.retained_count) == (1, 5, 6, 5)
    assert log.discard_through(2) == 2
    assert log.first_seq == 3 and log.get(2) is None and log.get(3).data == {"i": 2}
    assert log.discard_through(2) == 0  # idempotent
    assert log.discard_through(100) == 3
    assert log.retained_count == 0 and log.first_seq == 6


def test_subscription_replays_then_follows_and_is_exclusive():
    async def scenario() -> None:
        log = EventLog()
        for i in range(3):
            log.append("k", {"i": i})
        sub = log.subscribe(after_seq=1)  # discards seq 1
        assert log.attached and log.retained_count == 2
        assert [(await sub.next()).seq for _ in range(2)] == [2, 3]
        waiter = asyncio.ensure_future(sub.next())
        await asyncio.sleep(0)
        assert not waiter.done()
        log.append("k", {"i": 3})
        assert (await waiter).seq == 4
        # events stay retained until acknowledged, even once sent
        assert log.retained_count == 3
        second = log.subscribe(after_seq=3)
        assert sub.closed and await sub.next() is None
        assert (await second.next()).seq == 4
        log.unsubscribe(sub)  # an old subscription cannot detach the new one
        assert log.attached
        log.unsubscribe(second)
        assert not log.attached
        log.close()
        assert log.append("k", {}) is None and log.retained_count == 0

    run(scenario())


def test_subscription_skips_events_discarded_under_it():
    async def scenario() -> None:
        log = EventLog()
        for i in range(4):
            log.append("k", {"i": i})
        sub = log.subscribe(after_seq=0)
        log.discard_through(2)
        assert (await sub.next()).seq == 3

    run(scenario())


def test_events_are_always_sendable():
    assert plain({"n": 2**70, 1: (1, 2), "o": object}) == {"n": str(2**70), "1": [1, 2], "o": str(object)}
    data, packed = sendable("session_update", {"turn_id": "t", "n": 2**70})
    assert data == {"turn_id": "t", "n": str(2**70)} and msgpack.unpackb(packed) == data
    big, packed = sendable("session_update", {"turn_id": "t", "update": "x" * (MAX_EVENT_BYTES + 10)})
    assert big["turn_id"] == "t" and big["oversized"]["kind"] == "session_update"
    assert msgpack.unpackb(packed) == big
    small = {"turn_id": "t", "update": {"a": [1, 2.5, None, True]}}
    data, packed = sendable("session_update", small)
    assert data is small and msgpack.unpackb(packed) == small


# ---------------------------------------------------------------- instance pieces


def test_state_machine_transitions():
    S = InstanceState
    allowed = {
        (S.STARTING, S.RUNNING), (S.STARTING, S.EXITED), (S.STARTING, S.STOPPING),
        (S.RUNNING, S.EXITED), (S.RUNNING, S.STOPPING),
        (S.EXITED, S.STOPPING),
        (S.STOPPING, S.STOPPED),
    }
    for old in S:
        for new in S:
            assert can_transition(old, new) == ((old, new) in allowed), (old, new)


def test_turn_ids_are_unique_and_prefixed():
    ids = TurnIds("abc")
    made = [ids() for _ in range(1000)]
    assert len(set(made)) == 1000
    assert all(t.startswith("abc:") for t in made)
    assert TurnIds("other")() != made[0]


def test_agent_environment_is_minimal():
    """Issue 19 E: a fixed allow-list (never the server's PATH or HOME), then the request's env."""
    base = {k: f"v-{k}" for k in INHERITED_ENV} | {"SECRET_TOKEN": "x", "KANDEV_HOME": "/h",
                                                    "PATH": "/root/.local/bin:/usr/bin", "HOME": "/root"}
    env = agent_environment({"EXTRA": "1"}, base)
    assert set(env) == set(INHERITED_ENV) | {"EXTRA", "PATH", "HOME", "USER", "LOGNAME"}
    assert env["PATH"] == AGENT_PATH and env["HOME"] == "/tmp"
    assert "/root" not in " ".join(env.values())
    env = agent_environment({"PATH": "/override", "HOME": "/s/home"}, base)
    assert env["PATH"] == "/override" and env["HOME"] == "/s/home"
