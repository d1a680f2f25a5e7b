"""Issue 15 scenario B under real systemd: upgrading from the previous release's package.

The previous release's .deb is built from a clone of its tag (or recorded commit) and installed in
a fresh box; agent survival on, two sessions mid-turn; then ``apt-get install`` of this version.
The maintainer scripts reload the control server (0.2.0 can: it re-executes this version in place,
which reads the previous release's hand-over), then restart the backend, which adopts the server and
re-tracks both sessions: every agent keeps its pid, every chunk arrives once and in order. (A 0.1.0
server, which cannot reload and was replaced once idle, is two releases back: backend N adopts N-1.)

Issue 45 scenario F, Issue 45 item 6: a third session streams ``/flood 20000`` through the upgrade.
Its turn starts on the previous release just before ``apt-get install`` (whose backend is then
frozen, so that the turn is still streaming when the upgrade restarts it) and goes on after the new
backend has migrated the store (0.2.0 stored one row per chunk; the lean transcript coalesces them)
and re-tracked it: afterwards the transcript holds every chunk once and in order, and the
cursors the previous release handed out still name the same chunks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from daemon.core.version import VERSION
from tests.support.debs import build_packages, build_release_package
from tests.support.releases import Release, previous_release
from tests.support.sdbox import SdBox

BACKEND, AGENTCTL = "kandev-backend.service", "kandev-agentctl.service"
N = 40
FLOOD = 20_000
# 600 s bounds each test's own steps. The builds are module fixtures, made before the first step
# (so the sessions are mid-turn at the upgrade however long a cold build takes) and bounded by their
# own limits (each dpkg-buildpackage and lintian under its subprocess timeout in
# tests/support/debs.py; a cold build of this version and its upgrade took 500 s on a loaded 2-core
# machine, past the whole budget of the step that used to make it).
pytestmark = pytest.mark.timeout(600, func_only=True)
S: dict[str, Any] = {}  # state handed from one step to the next


@pytest.fixture(scope="module")
def release() -> Release:
    return previous_release()


@pytest.fixture(scope="module")
def release_deb(release: Release) -> Path:
    return build_release_package(release)


@pytest.fixture(scope="module")
def debs() -> dict[str, Any]:
    return build_packages()


@pytest.fixture(scope="module")
def box(sdbox: SdBox) -> SdBox:
    sdbox.run("rm", "-f", "/usr/sbin/policy-rc.d")  # as in test_package.py: the box stands for a machine
    sdbox.run("rm", "-f", "/var/lib/man-db/auto-update")  # as in test_package.py: no man-db trigger
    return sdbox


def _apt_install(box: SdBox, deb: Path) -> str:
    assert box.share is not None
    shutil.copy2(deb, box.share / deb.name)
    p = box.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q", "--no-install-recommends",
                "-o", "Dpkg::Options::=--force-confold", "install", f"/sdbox/{deb.name}", check=False, timeout=300)
    assert p.returncode == 0, f"apt-get install {deb.name}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def _kandev(box: SdBox, *args: str) -> dict[str, Any]:
    p = box.run("kandev", "--json", *args, check=False, timeout=120)
    assert p.returncode == 0, f"kandev {args}: rc={p.returncode} {p.stderr} {p.stdout}"
    return json.loads(p.stdout)


def _start(box: SdBox, task: str) -> str | None:
    """A new session of ``task``, or None while the backend is not linked to the restarted server yet."""
    p = box.run("kandev", "--json", "session", "start", task, check=False, timeout=120)
    return json.loads(p.stdout)["session_id"] if p.returncode == 0 else None


def _chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


def _page(box: SdBox, sid: str, after: int, limit: int) -> dict[str, Any]:
    return _kandev(box, "session", "show", sid, "--after-seq", str(after), "--limit", str(limit))


def _entries(box: SdBox, sid: str) -> list[dict[str, Any]]:
    """The session's whole transcript, page by page (``session show`` alone gives the last page)."""
    entries: list[dict[str, Any]] = []
    cursor = 0
    while True:
        show = _page(box, sid, cursor, 10_000)
        entries += show["transcript"]
        if not show["page"]["more_after"]:
            return entries
        cursor = show["page"]["next_cursor"]


def test_b_previous_release_with_sessions_mid_turn(release_deb: Path, debs: dict[str, Any], box: SdBox,
                                                   release: Release) -> None:
    _apt_install(box, release_deb)
    assert box.run("dpkg-query", "-W", "-f", "${Version}", "kandev").stdout == release.version
    conf = box.read_file("/etc/kandev/kandev.toml")
    box.write_file("/etc/kandev/kandev.toml", conf.replace("#agent_survival = false", "agent_survival = true"))
    box.systemctl("restart", BACKEND)
    st = _kandev(box, "status")
    assert st["capability"]["state"] == "enabled" and st["control_server"]["mode"] == "unit"
    assert st["backend"]["version"] == release.version
    S["ctl_pid"] = box.prop(AGENTCTL, "MainPID")
    # The namespaces the previous release's unit admits: a server reloaded in place keeps them.
    S["old_unit_net"] = "net" in box.prop(AGENTCTL, "RestrictNamespaces").split()
    sessions = []
    for i in range(2):
        task = _kandev(box, "task", "create", "--title", f"skew {i}")["task_id"]
        sid = _kandev(box, "session", "start", task)["session_id"]
        _kandev(box, "prompt", sid, f"/slow {N}")
        sessions.append(sid)
    agents = {}
    for sid in sessions:
        show = box.wait_for(lambda sid=sid: s if len(_chunks(s := _kandev(box, "session", "show", sid))) >= 2
                            else None, timeout=60)
        assert show and show["state"] == "RUNNING"
        agents[sid] = (show["agent_pid"], show["agent_pid_start_time"])
    # The flood's session starts now; its turn starts at the upgrade (a flood started here would be
    # over before it: the next step's only wait is for this one to be streaming).
    task = _kandev(box, "task", "create", "--title", "skew flood")["task_id"]
    flood = _kandev(box, "session", "start", task)["session_id"]
    show = box.wait_for(lambda: s if (s := _kandev(box, "session", "show", flood))["agent_pid"] else None, timeout=60)
    assert show, "the flood session's agent never started"
    agents[flood] = (show["agent_pid"], show["agent_pid_start_time"])
    S.update(sessions=sessions, agents=agents, flood=flood)


def test_b_upgrade_reloads_the_old_server_in_place_and_keeps_the_agents(box: SdBox, debs: dict[str, Any]) -> None:
    """Issue 15 scenario B: apt-get install of this version over the previous release. The previous
    release (0.2.0 or later) can reload: the maintainer scripts reload its control server, which re-executes
    this version in place (reading the previous release's hand-over), then restart the backend,
    which adopts it and re-tracks both sessions. Issue 45 scenario F: a ``/flood 20000`` streams
    through the upgrade and the store's migration; every chunk once and in order afterwards."""
    assert S, "needs the previous step"
    backend_pid = box.prop(BACKEND, "MainPID")
    flood = S["flood"]
    # A first short turn on the previous release: the cursors it hands out must still name the same
    # entries after the store's migration.
    _kandev(box, "prompt", flood, "/slow 5", "--wait")
    old_page = _page(box, flood, 0, 50)["transcript"]  # cursors handed out by the previous release
    assert [e["text"] for e in old_page if e["kind"] == "agent_message_chunk"] == [f"{i}/5 " for i in range(1, 6)]
    # The previous release stores the 20,000 chunks in a few seconds, faster than apt-get reaches the
    # backend's restart: its backend is frozen as soon as the turn has started, so the flood crosses
    # the upgrade, its chunks waiting in the control server (its backpressure holds the agent) through
    # the reload, the backend's restart (systemd follows the stop's SIGTERM with a SIGCONT) and the
    # store's migration. _check_flood's journal check proves the turn really crossed it.
    _kandev(box, "prompt", flood, f"/flood {FLOOD}")
    box.run("kill", "-STOP", backend_pid)
    out = _apt_install(box, debs["deb"])
    assert box.run("dpkg-query", "-W", "-f", "${Version}", "kandev").stdout == debs["version"]
    assert "kandev-agentctl was not reloaded" not in out, out[-3000:]
    assert box.prop(BACKEND, "MainPID") not in ("0", backend_pid)
    assert box.prop(AGENTCTL, "MainPID") == S["ctl_pid"] and box.prop(AGENTCTL, "ActiveState") == "active"
    for sid in S["sessions"]:
        show = box.wait_for(lambda sid=sid: s if (s := _kandev(box, "session", "show", sid))["retracked"] else None,
                            timeout=60)
        assert show, f"session {sid} was not re-tracked"
        assert (show["agent_pid"], show["agent_pid_start_time"]) == S["agents"][sid]
    new_backend = box.prop(BACKEND, "MainPID")
    ctl = _kandev(box, "status")["control_server"]
    assert ctl["version"] == VERSION and ctl["can_reload"] is True and ctl["installed_version"] == VERSION
    assert ctl["reexec_count"] >= 1 and ctl["replacement"] is None and str(ctl["pid"]) == S["ctl_pid"]

    for sid in S["sessions"]:  # the turns run to their end on the reloaded server
        show = box.wait_for(lambda sid=sid: s if (s := _kandev(box, "session", "show", sid))["state"]
                            == "WAITING_FOR_INPUT" else None, timeout=N + 90)
        assert show and _chunks(show) == [f"{i}/{N} " for i in range(1, N + 1)]
        assert [(t["state"], t["stop_reason"]) for t in show["turns"]] == [("finished", "end_turn")]
        assert box.alive(S["agents"][sid][0])
    _check_flood(box, flood, old_page, new_backend)
    assert box.prop(AGENTCTL, "MainPID") == S["ctl_pid"]
    assert not box.journal_json("-u", BACKEND, "KANDEV_EVENT=control_server_lost")
    task = _kandev(box, "task", "create", "--title", "after")["task_id"]
    if S["old_unit_net"]:  # the previous release's unit already admits a network namespace per agent
        sid = _start(box, task)
        assert sid, "no new session could start on the control server reloaded in place"
        assert _kandev(box, "status")["sandbox"]["network_namespace"] is True
        assert _kandev(box, "prompt", sid, "hello", "--wait")["stop_reason"] == "end_turn"
        return
    # A server reloaded in place keeps the namespace restrictions of the unit it was started under: a
    # unit before 0.3.0 admits no network namespace, and a new agent must get one (Issue 44), so it is
    # refused, saying how to fix it, and status says why, while the surviving agents keep running.
    p = box.run("kandev", "--json", "session", "start", task, check=False, timeout=120)
    assert p.returncode != 0, p.stdout
    error = json.loads(p.stdout)["error"]
    assert error["code"] == "sandbox_unavailable" and "systemctl stop kandev-agentctl" in error["message"], error
    sandbox = _kandev(box, "status")["sandbox"]
    assert sandbox["network_namespace"] is False and "systemctl stop kandev-agentctl" in sandbox["reason"], sandbox
    # Once its agents are done, stopping it has the backend start it again under the installed unit,
    # which gives every new agent its own namespace.
    for sid in [*S["sessions"], flood]:
        _kandev(box, "session", "stop", sid)
    box.systemctl("stop", AGENTCTL)
    sandbox = box.wait_for(lambda: s if (s := _kandev(box, "status")["sandbox"]).get("sandboxed") else None,
                           timeout=120)
    assert sandbox and sandbox["network_namespace"] is True, sandbox
    sid = box.wait_for(lambda: _start(box, task), timeout=60)
    assert sid, "no session could start after kandev-agentctl's restart"
    assert _kandev(box, "prompt", sid, "hello", "--wait")["stop_reason"] == "end_turn"


def _check_flood(box: SdBox, flood: str, old_page: list[dict[str, Any]], new_backend: str) -> None:
    """Issue 45 scenario F: the flood streamed through the upgrade; every chunk once and in order."""
    show = box.wait_for(lambda: s if (s := _kandev(box, "session", "show", flood, "--tail", "1"))["state"]
                        == "WAITING_FOR_INPUT" else None, timeout=300, interval=0.5)
    assert show, "the flood's turn never ended"
    assert [(t["state"], t["stop_reason"]) for t in show["turns"]] == [("finished", "end_turn")] * 2
    assert (show["agent_pid"], show["agent_pid_start_time"]) == S["agents"][flood]
    entries = _entries(box, flood)
    chunks = [e["text"] for e in entries if e["kind"] == "agent_message_chunk"]
    # the first turn's 5, then the flood's 20,000: every chunk once and in order
    assert chunks == [f"{i}/5 " for i in range(1, 6)] + [f"{i}/{FLOOD} " for i in range(1, FLOOD + 1)]
    by_cursor = {e["cursor"]: (e["kind"], e["text"]) for e in entries}
    assert [by_cursor.get(e["cursor"]) for e in old_page] == [(e["kind"], e["text"]) for e in old_page]
    # The scenario happened: the backend the upgrade started (on the migrated store) ended the turn.
    ended = [(m.get("_PID"), m.get("FROM_STATE")) for m in box.journal_json(
        "-u", BACKEND, "KANDEV_EVENT=session_state", f"SESSION_ID={flood}", "TO_STATE=WAITING_FOR_INPUT")]
    assert ended[-1:] == [(new_backend, "RUNNING")], (
        f"the flood did not stream through the upgrade (backend pids ending its turn: {ended}, last {new_backend}):\n"
        + _backend_story(box))


def _backend_story(box: SdBox) -> str:
    """The backend unit's starts, stops and state changes, for a failure's message."""
    log = box.run("journalctl", "-u", BACKEND, "-o", "short-monotonic", "--no-pager", check=False).stdout
    keep = ("Start", "Stopp", "exited", "watchdog", "Watchdog", "session_state", "migrat", "retrack", "signal")
    return "\n".join([line for line in log.splitlines() if any(k in line for k in keep)][-80:])
