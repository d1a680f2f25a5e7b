"""The control server re-executes in place (Issue 15), as a real process with real mock agents.

Each test runs ``kandev-agentctl`` from a private copy of the code tree (daemon/, ipc/), so it
can do what a package upgrade does: replace files under the running server (a newer version,
a module that raises at import) and reload. Reloads go through the unit's reload helper
(``kandev-agentctl --reload``) or the authenticated ``reload`` op, exactly as in production.

Cited: Issue 15 item 1 (hand-over), Issue 15 item 2 (preflight, refusal), Issue 15 item 3 (no
mixed code), Issue 15 item 6 (a client attached during the re-exec re-attaches with
``after_seq``: nothing lost, nothing repeated), Issue 15 scenario C (a broken new version is refused, the old process keeps serving).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.agentctl import auth, launch
from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import identify
from daemon.agentctl.protocol import EventKind
from daemon.core.version import VERSION
from daemon.host import process_start
from ipc.client import Event
from tests.support.aio import run
from tests.support.paths import REPO_ROOT
from tests.support.processes import identity, start_ticks
from tests.support.streams import wait_instance
from tests.support.waiting import eventually, wait_until
from tests.support.workspaces import for_agent

STEP = 30.0
pytestmark = pytest.mark.timeout(300)


@dataclass
class Server:
    """One control server started from ``code`` (a copy of the tree) and what tests need of it."""

    root: Path
    code: Path
    launch_file: Path
    socket_path: str
    log_path: Path
    credential: bytes
    installation_id: str
    workspace: Path
    proc: subprocess.Popen[bytes] | None = None
    agent_groups: set[int] = field(default_factory=set)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KANDEV_", "NOTIFY_", "CREDENTIALS_"))}
        env["PYTHONPATH"] = str(self.code)
        return env

    def connect(self) -> Any:
        return AgentctlClient.connect(self.socket_path, credential=self.credential,
                                      installation_id=self.installation_id)

    async def create(self, client: AgentctlClient, session: str, command: list[str] | None = None) -> dict[str, Any]:
        created = await client.create_instance(
            session_id=session, task_id=f"task-{session}", command=command or [sys.executable, "-m", "daemon.agents.mock"],
            cwd=str(self.workspace), env={"KANDEV_MOCK_STATE_DIR": str(self.root / "mock-state"),
                                          "PYTHONPATH": str(self.code)}, agent="mock",
            sandbox={"policy": "required", "writable": [str(self.root / "mock-state")]},
        )
        self.agent_groups.add(created["pid"])
        return created

    def reload_helper(self) -> subprocess.CompletedProcess[str]:
        """``kandev-agentctl --reload`` as ExecReload= runs it (same code tree, same user)."""
        assert self.proc is not None
        return subprocess.run(
            [sys.executable, "-m", "daemon.agentctl.main", "--reload", "--launch-file", str(self.launch_file),
             "--pid", str(self.proc.pid)],
            cwd=self.code, env=self.env(), capture_output=True, text=True, timeout=120,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def events(self, name: str) -> list[str]:
        return [line for line in self.log().splitlines() if f" {name} " in line]


def _copy_code(dest: Path) -> Path:
    code = dest / "code"
    for top in ("daemon", "ipc"):
        shutil.copytree(REPO_ROOT / top, code / top, ignore=shutil.ignore_patterns("__pycache__"))
    return code


@pytest.fixture
def server() -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="kd-rx-", dir="/var/tmp"))
    os.chmod(root, 0o700)
    home = root / "home"
    (home / "agentctl").mkdir(parents=True, mode=0o700)
    (root / "ws").mkdir()
    (root / "mock-state").mkdir()
    for_agent(root / "ws")  # the agents' (kandev-agent's when the tests run as root)
    for_agent(root / "mock-state")
    credential = auth.new_credential()
    cred_file = home / "agentctl" / "credential"
    launch.write_credential(cred_file, credential)
    config = launch.LaunchConfig(
        socket_path=str(home / "run" / "agentctl.sock"), log_path=str(home / "logs" / "agentctl.log"),
        agent_log_dir=str(home / "logs" / "agents"), installation_id=os.urandom(16).hex(),
        credential_file=str(cred_file), mode="detached",
    )
    launch_file = home / "agentctl" / "launch.json"
    launch.dump(config, launch_file)
    srv = Server(root=root, code=_copy_code(root), launch_file=launch_file, socket_path=config.socket_path,
                 log_path=Path(config.log_path), credential=credential, installation_id=config.installation_id,
                 workspace=root / "ws")
    srv.proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.agentctl.main", "--launch-file", str(launch_file)],
        cwd=srv.code, env=srv.env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(root / "server.stderr", "wb"), start_new_session=True,  # noqa: SIM115 - closed with the process
    )
    try:
        wait_until(lambda: srv.proc.poll() is not None or run(identify(srv.socket_path, timeout=1.0), 5),
                   timeout=STEP)
        assert srv.proc.poll() is None, (root / "server.stderr").read_text()
        yield srv
    finally:
        print(f"--- server log (tail)\n{srv.log()[-8000:]}")  # shown when the test fails
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
            try:
                srv.proc.wait(20)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait(10)
        for pgid in srv.agent_groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(root, ignore_errors=True)


def chunks(events: list[Event]) -> list[str]:
    return [e.data["update"]["content"]["text"] for e in events
            if e.kind == EventKind.SESSION_UPDATE and e.data["update"].get("sessionUpdate") == "agent_message_chunk"]


async def read_until(stream: Any, stop: Any, into: list[Event], timeout: float = STEP) -> None:
    """Append events to ``into`` until ``stop(event)``; returns quietly if the stream ends first."""
    async def read() -> None:
        async for event in stream:
            into.append(event)
            if stop(event):
                return

    await asyncio.wait_for(read(), timeout)


async def wait_info(client: AgentctlClient, predicate: Any, timeout: float = 120.0) -> dict[str, Any]:
    async def matching() -> dict[str, Any] | None:
        info = await client.server_info()
        return info if predicate(info) else None

    return await eventually(matching, timeout, interval=0.1, message="server_info matching")


# ---------------------------------------------------------------- the hand-over


def test_reload_hands_over_turns_permissions_and_held_back_output(server: Server) -> None:
    """Issue 15 item 1 and Issue 15 item 6: one agent mid-turn with a client attached, one with an open permission
    request and nobody attached, one whose output is held back at the detached bound (a message
    read and parked, more in the reader and the pipe). ``kandev-agentctl --reload`` (ExecReload=):
    same server pid, same agents, every chunk once and in order after re-attaching with after_seq,
    the permission answered after the reload ends its turn, turn ids go on from the same counter,
    and the same credential authenticates."""
    srv = server

    async def scenario() -> None:
        client = await srv.connect()
        slow = await srv.create(client, "slow")
        perm = await srv.create(client, "perm")
        flood = await srv.create(client, "flood")
        agents = {name: identity(inst["pid"]) for name, inst in (("slow", slow), ("perm", perm), ("flood", flood))}
        slow_turn = await client.prompt(slow["instance_id"], "/slow 12")
        await client.prompt(perm["instance_id"], "/permission")
        await client.prompt(flood["instance_id"], "/flood 400")
        seen: list[Event] = []
        stream = await client.attach(slow["instance_id"])
        await read_until(stream, lambda e: len(chunks(seen)) >= 2, seen)
        # the flood parks at the detached bound (100 retained); the permission request is open
        flood_listing = await wait_instance(client, flood["instance_id"], lambda i: i["paused"], STEP)
        assert flood_listing["retained_events"] == 100
        perm_request = await wait_permission(client, perm["instance_id"])
        before = await client.server_info()

        done = await asyncio.to_thread(srv.reload_helper)
        assert done.returncode == 0, (done.stdout, done.stderr, srv.log()[-3000:])
        assert "re-executed" in done.stdout

        # the attached stream was closed at a frame boundary; re-attach after the last seq seen
        await read_until(stream, lambda e: False, seen, timeout=STEP)
        last = seen[-1].seq
        stream = await client.attach(slow["instance_id"], after_seq=last)
        await read_until(stream, lambda e: e.kind == EventKind.TURN_ENDED, seen, timeout=60)
        await stream.close()
        seqs = [e.seq for e in seen]
        assert seqs == list(range(1, len(seqs) + 1)), "an event was lost or repeated across the re-exec"
        assert chunks(seen) == [f"{i}/12 " for i in range(1, 13)]
        assert seen[-1].data["turn_id"] == slow_turn and seen[-1].data["stop_reason"] == "end_turn"

        # the permission request survived: answering it now completes its turn
        await client.respond_permission(perm["instance_id"], perm_request, "allow")
        perm_events = await drain(client, perm["instance_id"])
        assert chunks(perm_events)[-1] == "permission: allow"
        assert perm_events[-1].kind == EventKind.TURN_ENDED and perm_events[-1].data["stop_reason"] == "end_turn"

        # the held-back flood: all 400 chunks, in order, once
        flood_events = await drain(client, flood["instance_id"], timeout=90)
        assert chunks(flood_events) == [f"{i}/400 " for i in range(1, 401)]
        assert [e.seq for e in flood_events] == list(range(1, len(flood_events) + 1))

        after = await client.server_info()
        assert after["pid"] == before["pid"] == srv.proc.pid
        assert after["reload"]["reexec_count"] == 1 and after["reload"]["last_outcome"] == "reexecuted"
        assert after["reload"]["last_from_version"] == VERSION
        for name, inst in (("slow", slow), ("perm", perm), ("flood", flood)):
            assert identity(inst["pid"]) == agents[name]
        listing = {i["instance_id"]: i for i in await client.list_instances()}
        assert all(i["not_taken_over"] == [] and i["state"] == "running" for i in listing.values())
        for inst in (slow, perm, flood):  # the new image reports the same stamp the spawn took
            assert listing[inst["instance_id"]]["pid_start_stamp"] == inst["pid_start_stamp"]
            assert inst["pid_start_stamp"] == process_start.stamp(inst["pid"])
        # the same turn counter: the next turn id follows the last one
        prefix, n = slow_turn.rsplit(":", 1)
        next_turn = await client.prompt(slow["instance_id"], "hello")
        assert next_turn.rsplit(":", 1)[0] == prefix and int(next_turn.rsplit(":", 1)[1]) > int(n)
        # a fresh connection authenticates with the same credential and identity
        again = await srv.connect()
        assert again.identity == client.identity
        await again.close()
        await client.close()

    run(scenario(), timeout=180.0)
    assert srv.proc.poll() is None
    assert srv.events("agentctl_reexecuted") and not srv.events("reload_refused")
    assert not srv.events("handover_incomplete")


async def wait_permission(client: AgentctlClient, instance_id: str) -> str:
    """The request id of the instance's open permission request (read without consuming: a stream
    attached and closed discards nothing the server retains beyond its after_seq)."""
    events: list[Event] = []
    stream = await client.attach(instance_id)
    await read_until(stream, lambda e: e.kind == EventKind.PERMISSION_REQUEST, events)
    await stream.close()
    return str(events[-1].data["request_id"])


async def drain(client: AgentctlClient, instance_id: str, timeout: float = STEP) -> list[Event]:
    """Every event of the instance until its turn ends (from seq 1: nothing was acked)."""
    events: list[Event] = []
    stream = await client.attach(instance_id)
    await read_until(stream, lambda e: e.kind == EventKind.TURN_ENDED, events, timeout)
    await stream.close()
    return events


# ---------------------------------------------------------------- sandboxed agents


def sandbox_tree(pid: int) -> dict[int, int]:
    """A sandboxed agent's processes as (pid -> start in clock ticks since boot): its bwrap (the
    group leader) and every descendant (bwrap's init in the agent's pid namespace, the agent, what
    the agent started)."""
    leader = psutil.Process(pid)
    return {p.pid: start_ticks(p.pid) for p in (leader, *leader.children(recursive=True))}


def still_running(tree: dict[int, int]) -> list[int]:
    """The processes of ``tree`` that still run (a zombie waiting for its reaper has ended)."""
    left = []
    for pid, started in tree.items():
        try:
            proc = psutil.Process(pid)
            if start_ticks(pid) == started and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


async def finish_turn(client: AgentctlClient, instance_id: str, text: str) -> str:
    """Run one turn to its end; its stop reason."""
    turn = await client.prompt(instance_id, text)

    async def stop_reason() -> str | None:
        status = await client.turn_status(instance_id)
        outcome = next((o for o in status["outcomes"] if o["turn_id"] == turn), None)
        return str(outcome["stop_reason"]) if outcome is not None and status["current_turn_id"] is None else None

    return await eventually(stop_reason, STEP, message=f"the end of turn {turn}")


def test_sandboxed_agents_survive_reloads_and_stop_still_ends_their_whole_sandbox(server: Server) -> None:
    """Issue 15 with Issue 10 (agents sandboxed by default): two agents in their bubblewrap
    sandboxes, one that leaves a TERM-ignoring process running inside its sandbox, one that ignores
    TERM itself, go through three reloads (the reload op twice, ``kandev-agentctl --reload`` once).
    Every sandbox process keeps its identity, each agent still answers a turn after each reload,
    and nothing is reported as not taken over. Then ``stop_instance`` ends each whole sandbox, every
    process of it included: the first on SIGTERM (its agent's exit ends its pid namespace, the
    TERM-ignoring process with it), the stubborn one on SIGKILL after the grace; the server's
    ``instance_stopped`` entries say which (AC-EXECUTORS-SURVIVAL-001.10). The sandbox probe travels
    with the state: ``sandbox_status`` answers from it and no image probes again."""
    srv = server
    stubborn_argv = ["/bin/sh", "-c", f"trap '' TERM; exec {sys.executable} -m daemon.agents.mock"]

    async def scenario() -> None:
        client = await srv.connect()
        plain = await srv.create(client, "plain")
        stubborn = await srv.create(client, "stubborn", command=stubborn_argv)
        assert plain["sandboxed"] is True and stubborn["sandboxed"] is True
        said = await finish_turn(client, plain["instance_id"],
                                 "/sh (trap '' TERM; exec sleep 300) </dev/null >/dev/null 2>&1 &")
        assert said == "end_turn"
        trees = {}
        for name, inst in (("plain", plain), ("stubborn", stubborn)):
            trees[name] = wait_until(lambda pid=inst["pid"], n=name: t if len(t := sandbox_tree(pid)) >= (
                4 if n == "plain" else 3) else None, timeout=STEP)  # bwrap, its init, the agent (and sleep)
            # bwrap, its init and the agent stay in the agent's group; the mock's /sh runs each command
            # in a group of its own (as a terminal tool does), inside the same sandbox
            apart = [psutil.Process(pid).cmdline() for pid in trees[name] if os.getpgid(pid) != inst["pid"]]
            assert apart == ([["sleep", "300"]] if name == "plain" else []), apart
        for i in range(3):
            if i == 1:
                done = await asyncio.to_thread(srv.reload_helper)
                assert done.returncode == 0, (done.stdout, done.stderr, srv.log()[-3000:])
            else:
                attempt = (await client.reload())["attempt"]
                info = await wait_info(client, lambda got, a=attempt: got["reload"]["last_attempt"] >= a
                                       and not got["reload"]["in_progress"])
                assert info["reload"]["last_outcome"] == "reexecuted", info
            for name, inst in (("plain", plain), ("stubborn", stubborn)):
                assert still_running(trees[name]) == sorted(trees[name]), f"{name}: a sandbox process ended"
                assert await finish_turn(client, inst["instance_id"], f"hello {i}") == "end_turn"
        info = await client.server_info()
        assert info["reload"]["reexec_count"] == 3 and info["pid"] == srv.proc.pid
        assert (await client.sandbox_status())["available"] is True  # the handed-over probe
        listing = {i["instance_id"]: i for i in await client.list_instances()}
        assert all(i["sandboxed"] and i["not_taken_over"] == [] and i["state"] == "running"
                   for i in listing.values()), listing
        for name, inst in (("plain", plain), ("stubborn", stubborn)):
            assert (await client.stop_instance(inst["instance_id"]))["stopped"] is True
            assert still_running(trees[name]) == [], f"{name}: processes of its sandbox outlived the stop"
        await client.close()

    run(scenario(), timeout=180.0)
    stopped = {line.split("session_id=")[1].split()[0]: line for line in srv.events("instance_stopped")}
    assert "stop_signal=SIGTERM" in stopped["plain"], stopped
    assert "stop_signal=SIGKILL" in stopped["stubborn"], stopped
    assert not srv.events("handover_incomplete")
    # every image probes for itself (the previous image's answer was for its own sandbox and unit);
    # the journal entry is written only when availability changes: once
    assert len(srv.events("sandbox_probe")) == 1, "the sandbox's availability changed across a reload"


# ---------------------------------------------------------------- preflight and refusal


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # as dpkg replaces a file: a new inode, the old one stays with whoever has it


def test_broken_new_version_is_refused_and_the_old_code_keeps_serving(server: Server) -> None:
    """Issue 15 scenario C (and item 2): the next version has a module that raises at import. The
    reload is refused by the preflight before anything pauses: same process, agent untouched, its
    turn streams on without a gap, new requests are served, the journal entry (reload_refused) says
    why and the reload helper exits 1. A second new version that cannot read the state (its format
    moved on) is refused after the quiesce: the quiesce is undone and nothing is lost. Once the
    files are fixed, the reload runs the new version (0.2.1 here) in the same process."""
    srv = server
    broken_py = srv.code / "daemon" / "agentctl" / "instance" / "instance.py"  # only the server imports it
    handover_py = srv.code / "daemon" / "agentctl" / "handover.py"
    version_py = srv.code / "daemon" / "core" / "version.py"
    good_instance, good_handover = broken_py.read_text(), handover_py.read_text()

    async def scenario() -> None:
        client = await srv.connect()
        inst = await srv.create(client, "c")
        agent = identity(inst["pid"])
        turn = await client.prompt(inst["instance_id"], "/slow 10")
        seen: list[Event] = []
        stream = await client.attach(inst["instance_id"])
        await read_until(stream, lambda e: len(chunks(seen)) >= 1, seen)

        _write(version_py, version_py.read_text().replace(f'VERSION = "{VERSION}"', 'VERSION = "0.2.1"'))
        _write(broken_py, good_instance + '\nraise RuntimeError("broken on purpose (Issue 15 scenario C)")\n')
        refused = await asyncio.to_thread(srv.reload_helper)
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        assert "broken on purpose" in refused.stderr
        info = await client.server_info()
        assert info["version"] == VERSION and info["pid"] == srv.proc.pid  # the old code, still serving
        assert info["reload"]["last_outcome"] == "refused" and "broken on purpose" in info["reload"]["last_reason"]
        assert info["reload"]["reexec_count"] == 0
        assert len(await client.list_instances()) == 1  # new requests are served

        # a version that cannot read this state: refused after the quiesce, which is undone
        _write(broken_py, good_instance)
        _write(handover_py, good_handover.replace("HANDOVER_FORMAT = 1", "HANDOVER_FORMAT = 2"))
        started = await client.reload()
        info = await wait_info(client, lambda i: i["reload"]["last_attempt"] >= started["attempt"]
                               and not i["reload"]["in_progress"])
        assert info["reload"]["last_outcome"] == "refused" and "state format" in info["reload"]["last_reason"]

        # the stream: closed by the (undone) quiesce at a frame boundary; nothing lost, nothing twice
        await read_until(stream, lambda e: e.kind == EventKind.TURN_ENDED, seen, timeout=STEP)
        if seen[-1].kind != EventKind.TURN_ENDED:
            stream = await client.attach(inst["instance_id"], after_seq=seen[-1].seq)
            await read_until(stream, lambda e: e.kind == EventKind.TURN_ENDED, seen, timeout=STEP)
        await stream.close()
        assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
        assert chunks(seen) == [f"{i}/10 " for i in range(1, 11)] and seen[-1].data["turn_id"] == turn
        assert identity(inst["pid"]) == agent

        _write(handover_py, good_handover)  # fixed: the reload goes through, to the new version
        started = await client.reload()
        info = await wait_info(client, lambda i: i["reload"]["last_attempt"] >= started["attempt"]
                               and not i["reload"]["in_progress"])
        assert info["reload"]["last_outcome"] == "reexecuted", info
        assert info["version"] == "0.2.1" and info["reload"]["last_from_version"] == VERSION
        assert info["pid"] == srv.proc.pid and identity(inst["pid"]) == agent
        await client.close()

    run(scenario(), timeout=180.0)
    refusals = srv.events("reload_refused")
    assert len(refusals) == 2
    assert "broken on purpose" in refusals[0] and "installed_version=0.2.1" in refusals[0]
    assert "state format" in refusals[1]


# ---------------------------------------------------------------- no mixed code


def test_nothing_is_imported_after_ready_and_replaced_files_change_nothing(server: Server) -> None:
    """Issue 15 item 3: everything the server runs is imported before READY=1. The test replaces
    version.py under the running server, then drives every kind of operation (spawn, turns,
    permission, cancel, mode, config option, context reset, streams and acks, turn outcomes,
    rotation and confirmation, claims, an agent that exits, stop, a reload) and checks that the
    server reported no late import of any non-standard-library module (its audit hook logs
    ``agentctl_late_import``) and went on reporting its own version until it re-executed."""
    srv = server
    version_py = srv.code / "daemon" / "core" / "version.py"

    async def exercise(client: AgentctlClient, session: str) -> None:
        inst = await srv.create(client, session)
        iid = inst["instance_id"]
        turn = await client.prompt(iid, "/slow 2")
        events = await drain(client, iid)
        await client.ack_events(iid, events[-1].seq)
        await client.ack_turn(turn)
        await client.prompt(iid, "/permission")
        request = await wait_permission(client, iid)
        await client.respond_permission(iid, request, "reject")
        await drain(client, iid)
        await client.prompt(iid, "/flood 50")
        await client.cancel(iid)
        await client.turn_status(iid)
        await client.set_mode(iid, "plan")
        await client.set_config_option(iid, "model", "mock-smart")

        async def idle() -> bool:
            return (await client.turn_status(iid))["current_turn_id"] is None

        await eventually(idle, STEP, message="no turn running")
        await client.reset_context(iid)
        await client.prompt(iid, "/exit 3")
        await wait_instance(client, iid, lambda i: i["state"] == "exited", STEP)
        await client.stop_instance(iid)

    async def scenario() -> None:
        client = await srv.connect()
        _write(version_py, version_py.read_text().replace(f'VERSION = "{VERSION}"', 'VERSION = "7.7.7"'))
        await exercise(client, "one")
        rotation, new_credential = await client.rotate()
        await client.reauthenticate(new_credential)
        await client.confirm_rotation(rotation)
        await client.claim()
        assert (await client.server_info())["version"] == VERSION  # the file changed, not the process
        started = await client.reload()
        info = await wait_info(client, lambda i: i["reload"]["last_attempt"] >= started["attempt"]
                               and not i["reload"]["in_progress"])
        assert info["reload"]["last_outcome"] == "reexecuted" and info["version"] == "7.7.7"
        await exercise(client, "two")  # the new image is watched too
        await client.claim()
        await client.close()

    run(scenario(), timeout=180.0)
    assert srv.events("agentctl_reexecuted")
    late = srv.events("agentctl_late_import")
    assert late == [], "modules imported after READY=1:\n" + "\n".join(late)
