"""Unit tests for ipc.peercred: SO_PEERCRED reading and the admission rule (real processes)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator

import pytest

from ipc.peercred import PeerCredentials, peer_admitted, peer_credentials, supplementary_groups
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


def test_peer_credentials_of_a_socketpair_are_ours() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        creds = peer_credentials(a)
    assert creds == PeerCredentials(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())


def test_admitted_by_uid() -> None:
    creds = PeerCredentials(pid=0, uid=1234, gid=99)
    assert peer_admitted(creds, {1234}, ())
    assert not peer_admitted(creds, {1}, ())


def test_admitted_by_primary_gid() -> None:
    creds = PeerCredentials(pid=0, uid=1234, gid=99)
    assert peer_admitted(creds, {1}, {99})
    assert not peer_admitted(creds, {1}, {98})


def test_no_allowed_gids_means_no_group_admission() -> None:
    creds = PeerCredentials(pid=os.getpid(), uid=1234, gid=99)
    assert not peer_admitted(creds, {1}, ())


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    """A live process running as uid 65534, gid 4242, supplementary group 4343."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to create a process of another uid")
    proc = subprocess.Popen(
        ["setpriv", "--reuid", "65534", "--regid", "4242", "--groups", "4343", "sleep", "30"],
        stdout=subprocess.DEVNULL,
    )
    try:

        def switched() -> bool:
            assert proc.poll() is None, "setpriv exited early"
            with open(f"/proc/{proc.pid}/status") as fh:
                return "\nUid:\t65534" in fh.read()

        wait_until(switched, timeout=10, message="setpriv child running as uid 65534")
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_supplementary_groups_read_from_proc(other_process: subprocess.Popen[bytes]) -> None:
    creds = PeerCredentials(pid=other_process.pid, uid=65534, gid=4242)
    assert supplementary_groups(creds) == frozenset({4343})
    assert peer_admitted(creds, {0}, {4343})
    assert not peer_admitted(creds, {0}, {4444})


def test_supplementary_groups_ignored_when_pid_does_not_match(other_process: subprocess.Popen[bytes]) -> None:
    # The recorded uid differs from the process now at that pid (as after pid reuse).
    creds = PeerCredentials(pid=other_process.pid, uid=65533, gid=4242)
    assert supplementary_groups(creds) == frozenset()
    assert not peer_admitted(creds, {0}, {4343})


def test_supplementary_groups_of_a_dead_process_are_empty() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait(timeout=10)
    creds = PeerCredentials(pid=proc.pid, uid=os.geteuid(), gid=os.getegid())
    assert supplementary_groups(creds) == frozenset()
