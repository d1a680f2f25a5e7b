"""The re-exec hand-over in process: the serialized state round-trips, decoding is strict about what
the new code needs and reports what it cannot use, the memfd is sealed, and every stateful piece
(ownership, event log, turn counter) is restored exactly (Issue 15 item 1; the exec path itself is
tested with real processes in tests/integration/test_agentctl_reexec.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.agentctl import handover
from daemon.agentctl.handover import (
    HandoverError,
    InstanceHandover,
    OwnershipHandover,
    PermissionHandover,
    ReloadHistory,
    RequestHandover,
    ServerHandover,
    decode,
    encode,
    from_fields,
    read_memfd,
    to_plain,
    write_memfd,
)
from daemon.agentctl.instance.conversation import TurnIds
from daemon.agentctl.instance.events import EventLog
from daemon.agentctl.instance.instance import Instance
from daemon.agentctl.instance.process import InstanceSpec
from daemon.agentctl.ownership import Ownership
from daemon.agentctl.reload.instance_handover import capture
from daemon.agentctl.reload.reexec import interpreter_flags
from daemon.agentctl.sandbox.bubblewrap import SandboxSupport
from ipc.errors import IpcError
from tests.support.paths import REPO_ROOT


def _instance(**over: object) -> InstanceHandover:
    spec = InstanceSpec(instance_id="i1", session_id="s1", task_id="t1", command=["agent", "--acp"], cwd="/w",
                        env={"API_KEY": "secret-value"}, agent="mock", workspace_roots=["/w"])
    fields = dict(
        spec=to_plain(spec), state="running", pid=4242, pid_start_time=1700000000.5, exit_code=None,
        reaped_returncode=None, acp_session_id="acp-1", session_info={"modes": None, "config_options": []},
        handshake_seq=2, detached_event_limit=100, limit_armed=True, current_turn_id="id:7",
        outcomes=[{"turn_id": "id:6", "stop_reason": "end_turn", "error": None}], next_seq=12,
        events=[[10, "session_update", {"turn_id": "id:7", "update": {"x": 1}}], [11, "turn_started", {"t": 2}]],
        stdout_fd=7, stdin_fd=8, unread=b'{"jsonrpc":"2.0","method":"session/update"}\n{"partial',
        next_request_id=9, requests=[RequestHandover(8, "session/prompt", "id:7")],
        permissions=[PermissionHandover("req-1", ["allow", "reject"], "id:7", "tool-1",
                                        {"jsonrpc": "2.0", "id": 3, "method": "session/request_permission"})],
        stderr_path="/logs/i1.stderr.log",
    )
    fields.update(over)
    return InstanceHandover(**fields)  # type: ignore[arg-type]


def _state(instances: list[InstanceHandover] | None = None) -> ServerHandover:
    return ServerHandover(
        format=handover.HANDOVER_FORMAT, from_version="0.2.0", pid=99, server_identity="ab" * 16,
        launch={"socket_path": "/run/a.sock", "log_path": "/l", "agent_log_dir": "/a", "installation_id": "x",
                "credential_file": None, "detached_event_limit": 100, "unowned_period_s": 600.0,
                "idle_timeout_s": 3600.0, "mode": "detached"},
        unowned_period_s=600.0, detached_event_limit=100, turn_counter=7, listen_fd=5, socket_path="/run/a.sock",
        socket_identity=[1, 2],
        ownership=OwnershipHandover(credentials=[[3, b"\x01" * 32], [4, b"\x02" * 32]], highest=4, confirmed=False,
                                    bootstrapped=True, started_at=10.0, last_renewal=20.5, period_s=600.0),
        reload=ReloadHistory(started_at=1.0, reexec_count=2, attempts=3, last_attempt=3),
        instances=instances if instances is not None else [_instance()], quiesced_at=30.0,
    )


def test_state_round_trips_exactly() -> None:
    """Issue 15 item 1: everything that travels comes back equal, fds and unread bytes included."""
    state = _state()
    back = decode(encode(state))
    assert back == state
    assert back.fds() == [5, 7, 8]
    assert back.instances[0].unread.endswith(b'{"partial')  # a half-read line travels as bytes


def test_sandbox_state_round_trips_and_is_optional() -> None:
    """Issue 15 with Issue 10: a sandboxed agent's spec (its bwrap argv, ``sandboxed``), bwrap's init
    by pid and start time, and the server's last sandbox probe travel; a state without them (a
    server that never probed, an unsandboxed agent) decodes to None."""
    spec = InstanceSpec(instance_id="i2", session_id="s2", task_id="t2", command=["agent"], cwd="/w",
                        launch_argv=["/usr/bin/bwrap", "--die-with-parent", "--", "agent"], sandboxed=True)
    state = _state([_instance(spec=to_plain(spec), sandbox_init_pid=4243, sandbox_init_start_time=1700000000.75)])
    state.sandbox_support = SandboxSupport(True, None, "/usr/bin/bwrap", "0.8.0")
    back = decode(encode(state))
    assert back == state and back.sandbox_support == SandboxSupport(True, None, "/usr/bin/bwrap", "0.8.0")
    lost: list[str] = []
    assert from_fields(InstanceSpec, back.instances[0].spec, "spec", lost) == spec and lost == []
    bare = decode(encode(_state()))
    assert bare.sandbox_support is None and bare.instances[0].sandbox_init_pid is None


def test_unknown_fields_are_reported_never_dropped_silently() -> None:
    """What the new code cannot take over is listed (names only: values may be secrets)."""
    doc = to_plain(_state())
    doc["future_server_field"] = {"x": 1}
    doc["instances"][0]["future_instance_field"] = "value"
    doc["instances"][0]["spec"]["sandbox_profile"] = "strict"
    back = decode(handover.msgpack.packb(doc, use_bin_type=True))
    assert back.lost == ["server.future_server_field (not known to this version)"]
    assert back.instances[0].not_taken_over == ["future_instance_field (not known to this version)"]
    lost: list[str] = []
    spec = from_fields(InstanceSpec, back.instances[0].spec, "spec", lost)
    assert spec.env == {"API_KEY": "secret-value"}
    assert lost == ["spec.sandbox_profile (not known to this version)"] and "strict" not in str(lost)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("listen_fd"), "field 'listen_fd' is missing"),
    (lambda d: d["instances"][0].update(pid="4242"), "server.instances[0].pid"),
    (lambda d: d.update(format=99), "state format 99"),
    (lambda d: d["ownership"].update(highest=True), "server.ownership.highest"),
])
def test_what_the_new_code_needs_is_checked(mutate: object, message: str) -> None:
    doc = to_plain(_state())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(HandoverError, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode(handover.msgpack.packb(doc, use_bin_type=True))
    with pytest.raises(HandoverError, match="not valid msgpack"):
        decode(b"\xc1")


class Isolation(enum.Enum):
    STRICT = "strict"
    OFF = "off"


@dataclasses.dataclass
class Mounts:
    read_only: list[str]
    private_tmp: bool = True


@dataclasses.dataclass
class FutureSpec(InstanceSpec):
    """InstanceSpec as a later version may extend it (the sandbox work adds fields)."""

    isolation: Isolation = Isolation.OFF
    state_dir: Path | None = None
    mounts: Mounts | None = None
    extra_args: tuple[str, ...] = ()


def test_instance_spec_travels_generically_with_new_field_types() -> None:
    """Every dataclass field of the spec is serialized by name and rebuilt from its annotation
    (enums, paths, nested dataclasses, tuples), so new InstanceSpec fields need no code here."""
    spec = FutureSpec(instance_id="i", session_id="s", task_id="t", command=["a"], cwd="/w",
                      isolation=Isolation.STRICT, state_dir=Path("/var/lib/x"),
                      mounts=Mounts(read_only=["/usr"], private_tmp=False), extra_args=("--x", "y"))
    plain = to_plain(spec)
    assert plain["isolation"] == "strict" and plain["state_dir"] == "/var/lib/x" and plain["extra_args"] == ["--x", "y"]
    raw = handover.msgpack.unpackb(handover.msgpack.packb(plain, use_bin_type=True), raw=False)
    lost: list[str] = []
    assert from_fields(FutureSpec, raw, "spec", lost) == spec and lost == []


def test_memfd_is_sealed_and_read_without_moving_the_offset() -> None:
    data = os.urandom(300_000)
    fd = write_memfd(data)
    try:
        assert read_memfd(fd) == data and read_memfd(fd) == data
        with pytest.raises(OSError) as err:
            os.pwrite(fd, b"x", 0)
        assert err.value.errno == errno.EPERM  # F_SEAL_WRITE: the preflight cannot alter it
        assert not os.get_inheritable(fd)  # inherited only by the exec that needs it
    finally:
        os.close(fd)


def test_ownership_snapshot_restores_rotation_state_and_timer() -> None:
    clock = [100.0]
    owner = Ownership(b"\x01" * 32, 600.0, clock=lambda: clock[0], new_credential=lambda: b"\x02" * 32)
    owner.bootstrap(0)
    rotation = owner.rotate_as(0)  # unconfirmed: both credentials acceptable
    clock[0] = 150.0
    snap = owner.snapshot()
    again = Ownership.from_snapshot(snap, clock=lambda: 160.0)
    assert again.acceptable_ids() == frozenset({0, 1}) and again.highest == 1 and not again.confirmed
    assert again.role(0) == "superseded" and again.role(1) == "current"
    assert again.last_renewal == owner.last_renewal == 100.0 and again.remaining() == pytest.approx(540.0)
    assert again.bootstrapped
    again.confirm(rotation.rotation_id)
    assert again.acceptable_ids() == frozenset({1})
    with pytest.raises(IpcError):
        again.check(0, "claim")
    owner.begin_shutdown("signal")
    with pytest.raises(RuntimeError):
        owner.snapshot()  # the shutdown latch ends a lifetime: never handed over


def test_event_log_and_turn_counter_go_on_where_they_stopped() -> None:
    log = EventLog(limit=3)
    log.restore(8, [(5, "session_update", {"a": 1}), (6, "turn_started", {}), (7, "turn_ended", {})])
    assert [e.seq for e in log.retained()] == [5, 6, 7] and log.next_seq == 8
    assert not log.has_room  # the detached bound sees the restored events
    assert log.append("session_update", {}).seq == 8
    with pytest.raises(RuntimeError):
        log.restore(1, [])
    with pytest.raises(ValueError):
        EventLog().restore(9, [(5, "x", {})])
    turns = TurnIds("abc", counter=41)
    assert turns() == "abc:42" and turns.counter == 42


def test_interpreter_flags_of_the_next_image() -> None:
    assert interpreter_flags(["/usr/lib/kandev/bin/python3", "-P", "-m", "daemon.agentctl.main", "-v"]) == ["-P"]
    assert interpreter_flags(["py", "-X", "dev", "-W", "error", "-u", "-m", "x"]) == ["-X", "dev", "-W", "error", "-u"]
    assert interpreter_flags(["py", "/venv/bin/kandev-agentctl", "--home", "h"]) == []


def test_late_import_watch_reports_modules_imported_after_ready() -> None:
    """Issue 15 item 3: the audit hook that checks "nothing imported after READY=1" does see a late
    import and tells a standard-library module from a third-party or kandev one."""
    script = """
import asyncio, json, sys
from daemon.agentctl.reload.preload import LateImportWatch
seen = []
async def main():
    watch = LateImportWatch(asyncio.get_running_loop(), lambda name, stdlib: seen.append([name, stdlib]))
    watch.install()
    import xml.dom.minidom  # noqa: F401  stdlib, not imported before
    import sqlalchemy  # noqa: F401  third party, not imported before
    await asyncio.sleep(0.05)
asyncio.run(main())
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, check=True).stdout
    seen = {name: stdlib for name, stdlib in json.loads(out)}
    assert seen.get("xml.dom.minidom") is True
    assert seen.get("sqlalchemy") is False


def test_agent_secrets_are_spawned_into_the_agent_then_never_kept_nor_handed_over(tmp_path) -> None:
    """Issue 12 with Issue 15: an agent's secret values go into its environment at spawn; the
    server keeps none of them afterwards, and a re-exec's state never carries them (the running
    agent has them already)."""
    out = tmp_path / "seen"
    spec = InstanceSpec(instance_id="i3", session_id="s3", task_id="t3", cwd=str(tmp_path),
                        command=["sh", "-c", f'printf %s "$AGENT_KEY" > {out}'], secret_env={"AGENT_KEY": "k-42-value"})
    inst = Instance(spec, agent_log_dir=tmp_path / "logs", turn_ids=lambda: "id:1")
    assert b"k-42-value" not in encode(_state([capture(inst)]))  # not even before the spawn

    async def spawn() -> None:
        await inst.spawn()
        assert inst.process is not None
        await inst.process.wait()

    asyncio.run(spawn())
    assert out.read_text() == "k-42-value" and spec.secret_env == {}
    state = capture(inst)
    assert "secret_env" not in state.spec and b"k-42-value" not in encode(_state([state]))
    lost: list[str] = []
    assert from_fields(InstanceSpec, state.spec, "spec", lost).secret_env == {} and lost == []
