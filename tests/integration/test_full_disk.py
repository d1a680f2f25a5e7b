"""A full disk is an event, not a loss (Issue 21 scenario E, Issue 21 item 5): real backend, control
server and mock agent, the kandev home on a 64 MiB tmpfs mounted for the test.

A filler file takes the filesystem's space but for a little, and the agent's ``/flood 20000`` uses up
the rest while it streams. The backend stays up, ``kandev status`` and ``kandev doctor`` say the
store is out of space (within 10 s of the filesystem filling), the agent keeps running (paused by the
control server at its bound); once the filler is removed the turn completes with every chunk exactly
once and in order, and the warning clears. With survival on and off, and with the disk already full
when the backend starts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.disk import Filler, free_bytes, small_filesystem
from tests.support.kandev import CliError, Kandev, make_env
from tests.support.processes import alive
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

N = 20_000
SLACK = 384 * 1024  # what the filler leaves: enough to start a turn, far from enough for its chunks
FULL = 64 * 1024  # free bytes below which the filesystem counts as full
REPORT_S = 10.0  # status says so within this long after the filesystem filled (the acceptance bound)


@pytest.fixture
def small_home(short_tmp: Path) -> Iterator[Any]:
    """A factory of Kandev homes on a 64 MiB tmpfs; every home is cleaned up before the unmount."""
    made: list[Kandev] = []
    with small_filesystem(short_tmp / "fs", "64m") as fs:

        def make(**env: str) -> tuple[Kandev, Filler]:
            config = short_tmp / "kandev.toml"
            config.write_text("")
            k = Kandev(fs / "home", make_env(config, **env))
            made.append(k)
            return k, Filler(fs)

        try:
            yield make
        finally:
            for k in made:
                Filler(fs).free()
                k.cleanup()


def _chunks(k: Kandev, sid: str) -> list[str]:
    return [e["text"] for e in k.transcript(sid) if e["kind"] == "agent_message_chunk"]


def _out_of_space(k: Kandev) -> dict[str, Any] | None:
    full: dict[str, Any] | None = (k.status().get("store") or {}).get("out_of_space")
    return full


def _flood_into_full_disk(k: Kandev, filler: Filler, sid: str) -> dict[str, Any]:
    """Take all space but ``SLACK``, start the flood, let it fill the rest: status says so in time."""
    filler.fill(leave=SLACK)
    k.cli("prompt", sid, f"/flood {N}")
    wait_until(lambda: free_bytes(filler.path.parent) < FULL, timeout=120, message="the flood never filled the disk")
    full_at = time.monotonic()
    report = wait_until(lambda: _out_of_space(k), timeout=REPORT_S + 5, interval=0.2)
    assert time.monotonic() - full_at <= REPORT_S + 1, "status took too long to say the store is out of space"
    assert report["path"].endswith("kandev.db") and report["free_bytes"] < FULL, report
    return report


def _check_reported_and_waiting(k: Kandev, sid: str, backend: int) -> None:
    """While full: the backend up, the agent alive and not done, doctor saying why."""
    show = k.show(sid)
    assert show["state"] == "RUNNING" and alive(int(show["agent_pid"])), show["state"]
    assert alive(backend)
    human = k.human("status")
    assert "out of space" in human.stdout, human.stdout
    doctor = json.loads(k.run("doctor").stdout)
    check = next(c for c in doctor["checks"] if c["name"] == "store_space")
    assert not check["ok"] and "out of space" in check["detail"], check


def _show_once_open(k: Kandev, sid: str) -> dict[str, Any] | None:
    """``session show``, or None while a backend that waited for space has not yet seen it come
    back (it looks again as the free space grows, or every few seconds): refused with the
    retryable ``store_out_of_space`` until it opened its store."""
    try:
        return k.show(sid)
    except CliError as exc:
        if "store_out_of_space" not in str(exc):
            raise
        return None


def _catches_up(k: Kandev, filler: Filler, sid: str) -> None:
    """Space back: the turn completes with every chunk once and in order, the warning clears."""
    filler.free()
    done = wait_until(lambda: s if (s := _show_once_open(k, sid)) and s["state"] == "WAITING_FOR_INPUT" else None,
                      timeout=300, interval=0.5)
    assert [(t["state"], t["stop_reason"]) for t in done["turns"]] == [("finished", "end_turn")]
    assert _chunks(k, sid) == [f"{i}/{N} " for i in range(1, N + 1)]
    wait_until(lambda: _out_of_space(k) is None, timeout=30, message="the out-of-space warning never cleared")
    assert k.status()["backend"]["state"] == "ready"


@pytest.mark.parametrize("survival", ["true", "false"])
def test_scenario_e_disk_fills_while_an_agent_floods(small_home: Any, survival: str) -> None:
    """Issue 21 scenario E (survival on, then off): the store fills mid-flood; nothing is lost."""
    k, filler = small_home(KANDEV_FEATURES_AGENT_SURVIVAL=survival)
    st = k.up()
    backend = int(st["backend"]["pid"])
    _, sid = k.start_session("flood")
    _flood_into_full_disk(k, filler, sid)
    _check_reported_and_waiting(k, sid, backend)
    _catches_up(k, filler, sid)
    assert int(k.status()["backend"]["pid"]) == backend  # the same backend all along


class _SocketWatch:
    """Stats the backend's CLI socket file from a thread, every millisecond: how often it was
    missing, and which sockets (inodes) it was."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.inodes: set[int] = set()
        self.missing = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.inodes.add(os.stat(self.path).st_ino)
            except FileNotFoundError:
                self.missing += 1
            self._stop.wait(0.001)

    def __enter__(self) -> _SocketWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_scenario_e_disk_already_full_when_the_backend_starts(small_home: Any) -> None:
    """Issue 21 scenario E (full at start): the backend starts on a full disk, says so and waits (no
    crash loop); once space is back it opens the store, re-tracks the agent and catches up."""
    k, filler = small_home(KANDEV_FEATURES_AGENT_SURVIVAL="true")
    st = k.up()
    server = int(st["control_server"]["pid"])
    _, sid = k.start_session("flood")
    _flood_into_full_disk(k, filler, sid)
    agent = int(k.show(sid)["agent_pid"])
    k.cli("down")
    filler.fill()  # whatever the backend's exit gave back: the disk is full when it starts
    up = k.cli("up", timeout=120)
    backend = int(up["pid"])
    k.backend_pids.add(backend)
    report = wait_until(lambda: _out_of_space(k), timeout=REPORT_S, interval=0.2)
    assert report["free_bytes"] < FULL, report
    assert k.status()["backend"]["state"] == "out_of_space"
    refused = k.run("session", "show", sid)
    assert refused.returncode != 0 and json.loads(refused.stdout)["error"]["code"] == "store_out_of_space"
    assert alive(backend) and int(k.status()["backend"]["pid"]) == backend  # waiting, not exiting and restarting
    assert alive(agent) and alive(server)
    # The server that waited hands its socket to the normal one: the CLI never finds none.
    with _SocketWatch(k.home / "run" / "backend.sock") as watch:
        _catches_up(k, filler, sid)
    assert watch.missing == 0 and len(watch.inodes) == 1, (watch.missing, watch.inodes)
    st = k.status()
    assert int(st["backend"]["pid"]) == backend and st["recovery"]["retracked"] == 1
    assert int(k.show(sid)["agent_pid"]) == agent
