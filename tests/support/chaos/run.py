"""The driver of a chaos run under the packaged units (Issue 45 item 1), in a booted ``SdBox``.

``ChaosRun(box, schedule).run()`` mounts a small tmpfs as the home (so it can be filled), installs
the units with agent survival on, starts the backend, then starts ``schedule.sessions`` sessions:
one holds a ``/permission`` request open across faults and answers it now and then, the others
stream ``/slow N`` and ``/flood N`` turns, a new one as soon as the last ended. For each fault of
the schedule: wait until every session streams (or asks), inject the fault, wait for the units to
be back, then check the invariants of ``invariants`` (bounded, from the moment the backend answers
again with a running control server: a session's liveness, its permission and the board within
``TRUTH_S``, the agents of a killed server gone within ``ORPHAN_S``, no transitional state past
``TRANSITIONAL_S``), resume every session left without an agent and start
the next turns. At the end every turn is let finish and checked once more.

Violations are collected, never raised, so a long run counts them all; ``report()`` prints the
seed, the count of each fault and every violation with the fault it followed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.support.chaos.invariants import PERMISSION_PROMPT, Tracked, ingest, unsettled
from tests.support.chaos.schedule import (
    AGENT_OOM,
    AGENTCTL_RELOAD,
    AGENTCTL_SIGKILL,
    BACKEND_RESTART,
    BACKEND_SIGKILL,
    DISK_FULL,
    FAULT_KINDS,
    Fault,
    Schedule,
    next_prompt,
    prompt_rng,
)
from tests.support.sdbox import SdBox

HOME = "/var/lib/kandev"
BACKEND, AGENTCTL = "kandev-backend.service", "kandev-agentctl.service"
FILLER = f"{HOME}/chaos-filler"
MAX_MEMORY = "512M"  # each agent's memory bound (agents.max_memory): a mock streams in far less
ALLOC_MIB = 2048  # what the OOM fault's agent allocates (/alloc), far past the bound
MEMORY_KILLED = "agent_killed: memory"
TRUTH_S = 5.0  # sessions' liveness, permissions and the board agree with the processes within this
ORPHAN_S = 15.0  # a killed control server's agents are gone within this (TimeoutStopSec=15s)
TRANSITIONAL_S = 30.0  # no session CREATED or STARTING past this
SPACE_S = 10.0  # status says the home is out of space (and that it is back) within this (Issue 45 item 3)
BACK_S = 90.0  # the units serve again after a fault within this
STREAM_S = 60.0  # every session streams again (or asks) within this after the check
_BOUNDS = {"truthful": TRUTH_S, "board": TRUTH_S, "orphans": ORPHAN_S, "transitional": TRANSITIONAL_S}


@dataclass
class Snapshot:
    status: dict[str, Any]
    tasks: list[dict[str, Any]]
    board: dict[str, list[str]]
    shows: dict[str, dict[str, Any]]
    procs: list[dict[str, Any]]


class ChaosRun:
    def __init__(self, box: SdBox, schedule: Schedule, out: Callable[[str], None] = print,
                 home_size: str = "384M") -> None:
        self.box, self.schedule, self.out, self.home_size = box, schedule, out, home_size
        self.prompts = prompt_rng(schedule.seed)
        self.counts: Counter[str] = Counter()
        self.violations: list[str] = []
        self.tracked: dict[str, Tracked] = {}
        self.fault: Fault | None = None
        self.turns_started = 0
        self.permissions_answered = 0
        self.skipped: Counter[str] = Counter()  # faults this box cannot make, by kind
        self.unbounded: str | None = None  # why agents' memory is unbounded here (no OOM faults then)
        self.idle: list[str] = []  # the sessions that have not streamed (or asked) yet this round
        self.streamed: set[str] = set()  # the sessions that have, this round

    # ---- talking to the box -----------------------------------------------------------------

    def batch(self, calls: list[tuple[str, dict[str, Any], float]], procs: bool = False,
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        request = json.dumps({"calls": [list(c) for c in calls], "procs": procs})
        p = self.box.run("env", f"PYTHONPATH={self.box.repo_root}", str(self.box.venv_bin / "python"), "-m",
                         "tests.support.chaos.box_batch", HOME, input=request, timeout=300)
        answer = json.loads(p.stdout)
        return answer["results"], answer["procs"]

    def call(self, op: str, args: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        return self.batch([(op, args or {}, timeout)])[0][0]

    def ok(self, op: str, args: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        result = self.call(op, args, timeout)
        if "error" in result:
            raise AssertionError(f"{op} {args}: {result['error']}")
        return result["ok"]

    def snapshot(self) -> Snapshot | None:
        """What the backend says and the process table, of (nearly) one moment; None while the
        backend does not answer. Each session's new transcript entries are ingested."""
        sids = list(self.tracked)
        calls: list[tuple[str, dict[str, Any], float]] = [("status", {}, 10.0), ("task_list", {}, 30.0),
                                                           ("board", {}, 30.0)]
        calls += [("session_show", {"session_id": s, "after_seq": self.tracked[s].cursor, "limit": 10_000}, 30.0)
                  for s in sids]
        results, procs = self.batch(calls, procs=True)
        if any("error" in r for r in results):
            return None
        shows = {}
        for sid, r in zip(sids, results[3:], strict=True):
            show = r["ok"]
            while show["page"]["more_after"]:  # a long flood since the last look: the rest, page by page
                more = self.call("session_show", {"session_id": sid, "after_seq": show["page"]["next_cursor"],
                                                  "limit": 10_000}, 30.0)
                if "error" in more:
                    return None
                more["ok"]["transcript"] = show["transcript"] + more["ok"]["transcript"]
                show = more["ok"]
            for problem in ingest(self.tracked[sid], show):
                self.violation(f"session {sid}: {problem}")
            shows[sid] = show
        return Snapshot(results[0]["ok"], results[1]["ok"]["tasks"], results[2]["ok"], shows, procs)

    def violation(self, what: str) -> None:
        where = f"fault #{self.fault.index} {self.fault.kind}" if self.fault else "before the first fault"
        line = f"seed {self.schedule.seed}, {where}: {what}"
        if line not in self.violations:
            self.violations.append(line)
            self.out(f"VIOLATION {line}")

    def wait(self, what: str, fn: Callable[[], Any], timeout: float) -> Any:
        """fn() once it is truthy (polled), else a violation and None after ``timeout``."""
        found = self.box.wait_for(fn, timeout=timeout, interval=0.2)
        if not found:
            self.violation(f"{what} (not within {timeout:g} s)")
        return found or None

    # ---- setting up ---------------------------------------------------------------------------

    def setup(self) -> None:
        box = self.box
        box.run("mkdir", "-p", HOME)
        box.run("mount", "-t", "tmpfs", "-o", f"size={self.home_size},mode=0750", "kandev-chaos-home", HOME)
        box.install_units()
        box.write_file("/etc/kandev/kandev.toml",
                       f'[features]\nagent_survival = true\n[agents]\nmax_memory = "{MAX_MEMORY}"\n')
        box.systemctl("start", BACKEND)  # Type=notify: returns once READY=1
        status = self.ok("status")
        assert status["capability"]["state"] == "enabled" and status["control_server"]["mode"] == "unit", status
        memory = status.get("memory") or {}
        if not memory.get("bounded"):
            self.unbounded = str(memory.get("reason") or "status says memory is unbounded")
        for i in range(self.schedule.sessions + 1):  # the last one is the OOM faults' victim
            task = self.ok("task_create", {"title": f"chaos {i}", "executor": "local"})["task_id"]
            sid = self.ok("session_start", {"task_id": task, "agent": None, "passthrough": False}, 180)["session_id"]
            self.tracked[sid] = Tracked(sid, task, permission=(i == 0), victim=(i == self.schedule.sessions))
        self.out(f"chaos: seed {self.schedule.seed}, {self.schedule.sessions} sessions, "
                 f"{len(self.schedule.faults)} faults (replay: KANDEV_CHAOS_SEED={self.schedule.seed} "
                 f"KANDEV_CHAOS_FAULTS={len(self.schedule.faults)})")

    # ---- faults ------------------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        box = self.box
        if fault.kind == BACKEND_SIGKILL:
            old = box.prop(BACKEND, "MainPID")
            box.systemctl("kill", "-s", "KILL", BACKEND)
            self.wait("the backend is restarted after its SIGKILL",
                      lambda: box.prop(BACKEND, "MainPID") not in ("0", old)
                      and box.prop(BACKEND, "ActiveState") == "active", BACK_S)
        elif fault.kind == BACKEND_RESTART:
            done = box.systemctl("restart", BACKEND, check=False, timeout=BACK_S + 300)
            if done.returncode:
                self.violation(f"systemctl restart {BACKEND} failed: {done.stderr.strip()[:300]}")
        elif fault.kind == AGENTCTL_SIGKILL:
            old = box.prop(AGENTCTL, "MainPID")
            box.systemctl("kill", "-s", "KILL", AGENTCTL)
            self.wait("a new control server runs after the SIGKILL of the last",
                      lambda: self._server_pid() not in (None, old), BACK_S)
        elif fault.kind == AGENTCTL_RELOAD:
            done = box.systemctl("reload", AGENTCTL, check=False, timeout=BACK_S + 60)
            if done.returncode:
                self.violation(f"systemctl reload {AGENTCTL} failed: {done.stderr.strip()[:300]}")
        elif fault.kind == DISK_FULL:
            box.run("sh", "-c", 'dd if=/dev/zero of="$1" bs=1M 2>/dev/null; exit 0', "sh", FILLER, timeout=120)
            try:
                if self.wait("status says the home is out of space", lambda: self._out_of_space() is True, SPACE_S):
                    self.snapshot()  # the streams' transcripts read back while the home is full
            finally:
                box.run("rm", "-f", FILLER)
            self.wait("status says the home has space again", lambda: self._out_of_space() is False,
                      SPACE_S + 10)
        elif fault.kind == AGENT_OOM:
            self._oom()
        else:
            raise ValueError(f"unknown fault {fault.kind!r}")

    def _oom(self) -> None:
        """The victim's agent allocates past its memory bound: it alone is killed (``agent_killed:
        memory``), the control server and the other agents stream on."""
        sid = next(s for s, t in self.tracked.items() if t.victim)
        server = self.box.prop(AGENTCTL, "MainPID")
        killed = len(self.box.journal_json("KANDEV_EVENT=agent_killed", "REASON=memory"))
        r = self.call("prompt", {"session_id": sid, "text": f"/alloc {ALLOC_MIB}", "wait": False})
        if "error" in r:
            self.violation(f"session {sid}: /alloc refused: {r['error']}")
            return
        self.turns_started += 1

        def killed_by_its_bound() -> bool:
            show = self.call("session_show", {"session_id": sid, "tail": 1}, 30).get("ok") or {}
            return not show.get("live", True) and (show.get("last_error") or "").startswith(MEMORY_KILLED)

        self.wait(f"session {sid}: its agent is killed by its memory bound ({MEMORY_KILLED})", killed_by_its_bound, 60)
        if len(self.box.journal_json("KANDEV_EVENT=agent_killed", "REASON=memory")) != killed + 1:
            self.violation("the journal has no new agent_killed entry with REASON=memory")
        if self.box.prop(AGENTCTL, "MainPID") != server or self.box.prop(AGENTCTL, "ActiveState") != "active":
            self.violation(f"{AGENTCTL} did not keep running through an agent's OOM kill")

    def _server_pid(self) -> str | None:
        r = self.call("status", {}, 10)
        server = (r.get("ok") or {}).get("control_server") or {}
        return str(server["pid"]) if server.get("state") == "running" and server.get("pid") else None

    def _out_of_space(self) -> bool | None:
        r = self.call("status", {}, 10)
        if "error" in r:
            return None
        return bool((r["ok"].get("store") or {}).get("out_of_space"))

    # ---- checks and healing -----------------------------------------------------------------

    def check(self) -> Snapshot | None:
        """Poll until every invariant holds; each that still fails past its bound is a violation."""
        if not self.wait("the backend answers, with a running control server", self._server_pid, BACK_S):
            return None
        start, reported = time.monotonic(), set()
        while True:
            snap = self.snapshot()
            elapsed = time.monotonic() - start
            if snap is None:
                if elapsed > TRANSITIONAL_S:
                    self.violation("the backend stopped answering during the check")
                    return None
                continue
            problems = unsettled(snap.status, snap.tasks, snap.board, snap.shows, snap.procs)
            for kind, found in problems.items():
                if found and elapsed > _BOUNDS[kind] and kind not in reported:
                    reported.add(kind)
                    self.violation(f"{kind} after {_BOUNDS[kind]:g} s: " + "; ".join(found[:4]))
            if not any(problems.values()) or elapsed > max(_BOUNDS.values()):
                return snap

    def heal_and_stream(self, snap: Snapshot, answer_permission: bool) -> None:
        """Resume each session left without an agent, answer the permission request if asked,
        start the next turn of each idle session; then wait until every session streams (or asks)."""
        for sid, show in snap.shows.items():
            if not show["live"] and show["state"] in ("WAITING_FOR_INPUT", "FAILED"):
                self._resume(sid)
        if answer_permission:
            for sid, show in snap.shows.items():
                for p in show["permissions"]:
                    if self.tracked[sid].permission and p["state"] == "open":
                        r = self.call("permission_respond", {"session_id": sid, "request_id": p["request_id"],
                                                             "option_id": "allow"})
                        if "error" in r:
                            self.violation(f"session {sid}: answering permission {p['request_id']}: {r['error']}")
                        self.permissions_answered += 1
        self.streamed = set()
        if not self.box.wait_for(self._streaming, timeout=STREAM_S, interval=0.2):
            self.violation(f"not every session streams or asks {STREAM_S:g} s after the check: {self.idle}")

    def _resume(self, sid: str) -> None:
        """Give the session an agent again: ``kandev resume``, unless automatic resume (on by
        default) gets there first; a resume refused while that runs is asked again."""
        errors: list[dict[str, Any]] = []

        def resumed() -> bool:
            show = self.call("session_show", {"session_id": sid, "tail": 1}, 30)
            if "ok" in show and show["ok"]["live"]:
                return True
            if "ok" in show and show["ok"]["state"] in ("CREATED", "STARTING"):
                return False  # automatic resume is at it
            r = self.call("session_resume", {"session_id": sid, "fresh": False}, 180)
            if "error" in r:
                errors[:] = [r["error"]]
            return "ok" in r

        if not self.box.wait_for(resumed, timeout=60, interval=0.5):
            self.violation(f"session {sid} has no agent 60 s after the check (last resume error: {errors})")

    def _streaming(self) -> bool:
        """Start the next turn where a session waits for input; True once every session has
        streamed (a turn started, or its open turn has a chunk) or asked (its permission request
        is open) since this round began (``self.streamed`` is reset before each round: with short
        floods, all of them mid-turn at one look is rare on a loaded machine)."""
        snap = self.snapshot()
        if snap is None:
            return False
        calls: list[tuple[str, dict[str, Any], float]] = []
        for sid, show in snap.shows.items():
            tracked = self.tracked[sid]
            turn = tracked.open_turn()
            if tracked.victim:
                continue
            if show["state"] == "WAITING_FOR_INPUT" and show["live"] and turn is None:
                text = PERMISSION_PROMPT if tracked.permission else next_prompt(self.prompts)
                calls.append(("prompt", {"session_id": sid, "text": text, "wait": False}, 60.0))
            elif (any(p["state"] == "open" for p in show["permissions"]) if tracked.permission
                  else turn is not None and bool(turn.chunks)):
                self.streamed.add(sid)
        if calls:
            for (op, args, _), r in zip(calls, self.batch(calls)[0], strict=True):
                if "error" in r:
                    self.violation(f"session {args['session_id']}: {op} {args['text']!r} refused: {r['error']}")
                else:
                    self.turns_started += 1
                    if not self.tracked[args["session_id"]].permission:
                        self.streamed.add(args["session_id"])
        self.idle = [f"{sid} {show['state']} live={show['live']}" for sid, show in snap.shows.items()
                     if not self.tracked[sid].victim and sid not in self.streamed]
        return not self.idle

    # ---- the run ------------------------------------------------------------------------------

    def run(self) -> None:
        self.setup()
        self.wait("every session streams or asks", self._streaming, STREAM_S)  # self.streamed starts empty
        for fault in self.schedule.faults:
            self.fault = fault
            t0 = time.monotonic()
            if fault.kind == AGENT_OOM and self.unbounded:
                self.skipped[fault.kind] += 1  # the schedule stays the seed's: this fault is left out
                continue
            self.inject(fault)
            self.counts[fault.kind] += 1
            t1 = time.monotonic()
            snap = self.check()
            if snap is None:
                self.out(f"chaos: fault #{fault.index} {fault.kind}: the units never came back; stopping")
                break
            t2 = time.monotonic()
            self.heal_and_stream(snap, fault.answer_permission)
            self.out(f"chaos: fault #{fault.index} {fault.kind}: injected and back {t1 - t0:.1f} s, checked "
                     f"{t2 - t1:.1f} s, streaming again {time.monotonic() - t2:.1f} s; "
                     f"{len(self.violations)} violations so far")
        self.finish()

    def finish(self) -> None:
        """Answer the last permission request, let every turn end, check the transcripts once more."""
        snap = self.check()
        if snap is None:
            return
        self.heal_and_stream(snap, answer_permission=True)

        def all_ended() -> bool:
            snap = self.snapshot()
            if snap is None:
                return False
            for sid, show in snap.shows.items():
                for p in show["permissions"]:
                    if p["state"] == "open":
                        self.call("permission_respond", {"session_id": sid, "request_id": p["request_id"],
                                                         "option_id": "allow"})
            return all(t.open_turn() is None for t in self.tracked.values())

        self.wait("every turn ended at the end of the run", all_ended, 120)

    def report(self) -> str:
        lines = [f"chaos: seed {self.schedule.seed}, {self.schedule.sessions} sessions, "
                 f"{sum(self.counts.values())} of {len(self.schedule.faults)} faults, "
                 f"{self.turns_started} turns started, {self.permissions_answered} permission answers",
                 "faults: " + ", ".join(f"{k} {self.counts[k]}" for k in FAULT_KINDS),
                 *([f"left out: {self.skipped[AGENT_OOM]} agent_oom (agents' memory is unbounded in this box: "
                    f"{self.unbounded})"] if self.skipped else []),
                 f"invariant violations: {len(self.violations)}", *self.violations,
                 f"replay: KANDEV_CHAOS_SEED={self.schedule.seed} KANDEV_CHAOS_FAULTS={len(self.schedule.faults)}"]
        return "\n".join(lines)
