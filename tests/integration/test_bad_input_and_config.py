"""Issue 2 scenario E (bad input to either socket) and Issue 2 scenario F (config out of range).

Bad input gets a typed error or a closed connection; the daemon keeps
answering and nothing in the store changes. Config values outside their range
are rejected at start with the key, the value and the range; the daemon does
not start.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.support.paths import REPO_ROOT
from tests.support.wire import read_frame_body

pytestmark = pytest.mark.timeout(180)


def _db_snapshot(db: Path) -> dict[str, list[Any]]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        return {t: sorted(map(repr, con.execute(f'SELECT * FROM "{t}"').fetchall())) for t in tables}
    finally:
        con.close()


def _recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """One reply frame, or None if the server closed the connection."""
    sock.settimeout(10)
    body = read_frame_body(sock)
    return None if body is None else msgpack.unpackb(body, raw=False)


def _send_raw(path: str, payload: bytes) -> dict[str, Any] | None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(payload)
        try:
            return _recv_frame(s)
        except (ConnectionResetError, BrokenPipeError):
            return None


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _assert_refused(reply: dict[str, Any] | None, *codes: str) -> None:
    if reply is None:
        return  # a closed connection is an accepted refusal
    assert reply["ok"] is False
    assert reply["error"]["code"] in codes, reply


BAD_INPUTS = {
    "random_bytes": (os.urandom(64), ("invalid_frame", "frame_too_large")),
    "100MiB_prefix": (struct.pack(">I", 100 * 1024 * 1024) + b"x" * 16, ("frame_too_large",)),
    "unknown_op": (_frame({"v": 1, "id": 1, "op": "no_such_op", "args": {}}), ("unknown_op",)),
    "missing_fields": (_frame({"v": 1, "id": 2, "op": "prompt", "args": {}}),
                       ("invalid_argument", "unauthenticated")),
    "not_a_map": (_frame([1, 2, 3]), ("invalid_frame",)),
    "missing_envelope": (_frame({"v": 1, "args": {}}), ("invalid_frame",)),
}


def _other_uid_probe(path: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX)\n"
        f"s.connect({path!r})\n"
        "s.settimeout(10)\n"
        "try:\n"
        "    d=s.recv(4096)\n"  # the server speaks first only to refuse
        "    s.sendall(b'\\x00\\x00\\x00\\x05\\x81\\xa2id\\x01\\x00')\n"
        "    d+=s.recv(4096)\n"
        "except (BrokenPipeError, ConnectionResetError):\n"
        "    d=b''\n"
        "print('closed' if not d else ('permission_denied' if b'permission_denied' in d else 'answered'))\n"
    )
    return subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_scenario_e_bad_input_to_both_sockets(kandev_factory):
    """Malformed, oversized, unknown and foreign-uid input is refused; daemons keep serving; store unchanged."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    task, sid = k.start_session("bad input")
    k.cli("prompt", sid, "hello", "--wait")
    db = k.home / "kandev.db"
    before = _db_snapshot(db)
    sockets = {"backend": st["backend"]["socket"], "agentctl": st["control_server"]["endpoint"]}
    for name, path in sockets.items():
        for case, (payload, codes) in BAD_INPUTS.items():
            reply = _send_raw(path, payload)
            _assert_refused(reply, *codes)
            # The daemon still answers a well-formed request afterwards.
            after = _send_raw(path, _frame({"v": 1, "id": 9, "op": "hello", "args": {}}))
            assert after is not None and after["ok"] is True, (name, case, after)
        # A peer of another uid: make the path reachable for it, so the refusal can only come
        # from the SO_PEERCRED check, then restore the modes.
        run_dir = Path(path).parent
        opened = (k.home.parent, k.home, run_dir)
        modes = {p: p.stat().st_mode & 0o777 for p in (*opened, Path(path))}
        try:
            for p in opened:
                os.chmod(p, 0o755)
            os.chmod(path, 0o666)
            probe = _other_uid_probe(path)
        finally:
            for p, mode in modes.items():
                os.chmod(p, mode)
        assert probe.returncode == 0, probe.stderr
        assert probe.stdout.strip() in ("closed", "permission_denied"), (name, probe.stdout)
    assert k.status()["backend"]["state"] == "ready"
    assert _db_snapshot(db) == before


def _start_backend_once(k) -> subprocess.CompletedProcess[str]:
    """Run kandev-backend in the foreground; with bad config it must exit at once."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.backend.main", "--home", str(k.home)],
        capture_output=True,
        text=True,
        env=k.env,
        timeout=60,
        cwd=REPO_ROOT,
    )


@pytest.mark.parametrize(
    ("env", "key", "value", "range_text"),
    [
        ({"KANDEV_AGENTCTL_RECOVERY_DEADLINE": "500ms"}, "agentctl.recovery_deadline", "500ms", "1s..5min"),
        ({"KANDEV_AGENTCTL_RECOVERY_DEADLINE": "6min"}, "agentctl.recovery_deadline", "6min", "1s..5min"),
        ({"KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "11"}, "agentctl.recovery_read_retries", "11", "0..10"),
        ({"KANDEV_AGENTCTL_RECOVERY_READ_TIMEOUT": "50ms"}, "agentctl.recovery_read_timeout", "50ms", "100ms"),
        ({"KANDEV_AGENTCTL_DETACHED_EVENT_LIMIT": "0"}, "agentctl.detached_event_limit", "0", "1..10000"),
        ({"KANDEV_AGENTCTL_UNOWNED_PERIOD": "25h"}, "agentctl.unowned_period", "25h", "24h"),
    ],
)
def test_scenario_f_backend_rejects_out_of_range_config(kandev_factory, env, key, value, range_text):
    """AC-EXECUTORS-SURVIVAL-003.7, AC-EXECUTORS-SURVIVAL-002.13, AC-EXECUTORS-SURVIVAL-001.8: rejected at start, never clamped; the daemon does not start."""
    k = kandev_factory(**env)
    proc = _start_backend_once(k)
    assert proc.returncode == 2
    assert key in proc.stderr and value in proc.stderr and range_text in proc.stderr, proc.stderr
    assert not (k.home / "run" / "backend.sock").exists()


def test_scenario_f_budget_cross_check_explains_itself(kandev_factory):
    """AC-EXECUTORS-SURVIVAL-002.13: T x (R+1) <= min(6s, D/5), and the message says so."""
    k = kandev_factory(KANDEV_AGENTCTL_RECOVERY_DEADLINE="20s")
    proc = _start_backend_once(k)
    assert proc.returncode == 2
    assert "recovery_deadline" in proc.stderr and "30" in proc.stderr, proc.stderr
