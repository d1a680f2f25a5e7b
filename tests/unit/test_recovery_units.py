"""Pure parts of recovery: liveness classification rules and reconstruction sources."""

from __future__ import annotations

import os

import psutil
import pytest

from daemon.backend.recovery.liveness import DEAD, LIVE, UNKNOWN, Scope, classify, pid_probe
from daemon.backend.recovery.reconstruction import RECONSTRUCTION_SOURCES, MissingInput, Record, reconstruct
from daemon.backend.state.agent_identity import AgentIdentity as Agent
from daemon.host import process_start

ME = psutil.Process(os.getpid())


def _classify(scope: Scope, instance: str = "i1", created_by: str = "old", pid: int | None = None,
              start: float | None = None) -> str:
    return classify(instance_id=instance, agent=Agent(pid, start), created_by_boot=created_by, scope=scope)


def test_pid_probe_checks_pid_and_start_time():
    """AC-EXECUTORS-SURVIVAL-005.1: today's process-identifier probe, robust to pid reuse."""
    assert pid_probe(Agent(os.getpid(), ME.create_time())) == LIVE
    assert pid_probe(Agent(os.getpid(), ME.create_time() - 1000)) == DEAD  # reused pid
    assert pid_probe(Agent(None)) == DEAD
    assert pid_probe(Agent(2**22 + 12345, 1.0)) == DEAD


def test_pid_probe_by_stamp_holds_across_a_step_of_the_wall_clock():
    """A recorded stamp (boot id and start ticks) decides, not the wall-clock start time: a step
    of the clock after the start was recorded (the recorded time now 16 s off, as CI saw) leaves
    a running agent live; another start or another boot is another process."""
    mine = process_start.stamp(os.getpid())
    assert mine is not None
    boot, ticks = mine.split(":")
    assert pid_probe(Agent(os.getpid(), ME.create_time() - 16.0, mine)) == LIVE
    assert pid_probe(Agent(os.getpid(), ME.create_time(), f"{boot}:{int(ticks) - 1}")) == DEAD  # reused pid
    other_boot = f"00000000-0000-0000-0000-000000000000:{ticks}"
    assert pid_probe(Agent(os.getpid(), ME.create_time(), other_boot)) == DEAD
    scope = Scope(disabled=True, adopted=False, answered=False)
    assert classify(instance_id="i1", agent=Agent(os.getpid(), ME.create_time() - 16.0, mine),
                    created_by_boot="old", scope=scope) == LIVE


def test_liveness_rules_of_003_6():
    """AC-EXECUTORS-SURVIVAL-003.6: own instance presence; unknown never live or dead; scope by origin."""
    live_pid = {"pid": os.getpid(), "start": ME.create_time()}
    # rule 9: disabled → pid probe
    assert _classify(Scope(disabled=True, adopted=False, answered=True), **live_pid) == LIVE
    # rule 7: a server answered but was not adopted → inherited rows unknown, even with a live pid
    assert _classify(Scope(disabled=False, adopted=False, answered=True), **live_pid) == UNKNOWN
    # rule 7: nothing answered → pid probe, so dead rows are still repaired
    assert _classify(Scope(disabled=False, adopted=False, answered=False)) == DEAD
    # rules 1, 3: adopted → presence in the one enumeration of the pass, not the server being up
    adopted = Scope(disabled=False, adopted=True, answered=True, enumeration={"i1"})
    assert _classify(adopted, "i1") == LIVE
    assert _classify(adopted, "i2", **live_pid) == DEAD
    # rule 2: presence undeterminable → unknown
    assert _classify(Scope(disabled=False, adopted=True, answered=True, enumeration=None)) == UNKNOWN
    # rule 5: a stop in flight when the enumeration was taken → unknown
    inflight = Scope(disabled=False, adopted=True, answered=True, enumeration={"i1"}, stops_in_flight={"i1"})
    assert _classify(inflight, "i1") == UNKNOWN
    # rule 6: rows this backend created are judged against the server it uses, adopted or started
    started = Scope(disabled=False, adopted=False, answered=True, enumeration={"i1"}, created_by_us="boot")
    assert _classify(started, "i1", created_by="boot") == LIVE
    assert _classify(started, "i9", created_by="boot") == DEAD
    assert _classify(started, "i1", created_by="old") == UNKNOWN


def _record(**over: object) -> Record:
    base = dict(session_id="s", task_id="t", instance_id="i", last_event_seq=7, passthrough=False,
                agent_profile="mock", workspace_path="/w")
    base.update(over)
    return Record(**base)  # type: ignore[arg-type]


INSTANCE = {"instance_id": "i", "acp_session_id": "acp", "workspace_roots": ["/w"], "pid": 10,
            "pid_start_time": 1.0, "env": {"SECRET": "x"}}


def test_every_value_has_one_declared_source():
    """AC-EXECUTORS-SURVIVAL-002.3, AC-EXECUTORS-SURVIVAL-002.14: one source each, from the four allowed."""
    assert set(RECONSTRUCTION_SOURCES.values()) <= {"a", "b", "c", "d"}
    values = reconstruct(_record(), INSTANCE)
    assert set(values) == set(RECONSTRUCTION_SOURCES)
    # (d) re-derived from the profile and today's registry, never read from the instance
    from daemon.agents.registry import get_agent

    assert values["agent_command"] == list(get_agent("mock").argv())
    assert "env" not in values  # the instance's environment is never taken into backend state


def test_workspace_roots_come_from_the_instance_only():
    """AC-EXECUTORS-SURVIVAL-002.5: reach is read back from the instance, never widened or pushed."""
    values = reconstruct(_record(workspace_path="/w"), {**INSTANCE, "workspace_roots": ["/w/sub"]})
    assert values["workspace_roots"] == ["/w/sub"]


@pytest.mark.parametrize("missing", ["acp_session_id", "workspace_roots", "pid"])
def test_authoritatively_absent_value_refuses_retracking(missing):
    """AC-EXECUTORS-SURVIVAL-002.4: the missing value is named."""
    with pytest.raises(MissingInput) as exc:
        reconstruct(_record(), {**INSTANCE, missing: None})
    assert exc.value.name == ("agent_pid" if missing == "pid" else missing)


def test_unknown_profile_cannot_be_rederived():
    """AC-EXECUTORS-SURVIVAL-002.4, AC-EXECUTORS-SURVIVAL-002.14 (source d)."""
    with pytest.raises(MissingInput) as exc:
        reconstruct(_record(agent_profile="gone-agent"), INSTANCE)
    assert exc.value.name == "agent_command"
