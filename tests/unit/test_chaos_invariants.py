"""The invariant checker of the chaos run under systemd (Issue 45 scenario A) catches what it is
for: a chunk twice or out of order, a chunk after its turn ended, a turn ended twice, an agent no
session accounts for, a session or a board that does not match the processes."""

from __future__ import annotations

from typing import Any

from tests.support.chaos.invariants import AGENTCTL_UNIT, Tracked, ingest, unsettled


def _show(state: str, turns: list[tuple[str, str, str | None]], chunks: list[tuple[str, str]], *,
          live: bool = True, agent_pid: int = 50, permissions: list[dict[str, Any]] | None = None,
          cursor: int = 0) -> dict[str, Any]:
    return {"state": state, "live": live, "agent_pid": agent_pid, "permissions": permissions or [],
            "turns": [{"turn_id": t, "prompt": p, "state": "open" if r is None else "finished", "stop_reason": r}
                      for t, p, r in turns],
            "transcript": [{"kind": "agent_message_chunk", "turn_id": t, "text": x, "cursor": cursor + i + 1}
                           for i, (t, x) in enumerate(chunks)]}


def test_chunks_once_in_order_and_complete() -> None:
    ok = Tracked("s", "t", permission=False)
    assert ingest(ok, _show("WAITING_FOR_INPUT", [("a", "/slow 3", "end_turn")],
                            [("a", "1/3 "), ("a", "2/3 "), ("a", "3/3 ")])) == []
    twice = Tracked("s", "t", permission=False)
    assert "chunk 3 is '2/3 '" in ingest(twice, _show("RUNNING", [("a", "/flood 3", None)],
                                                      [("a", "1/3 "), ("a", "2/3 "), ("a", "2/3 ")]))[0]
    short = Tracked("s", "t", permission=False)
    assert "ended end_turn with 2 of 3" in ingest(short, _show("WAITING_FOR_INPUT", [("a", "/slow 3", "end_turn")],
                                                                [("a", "1/3 "), ("a", "2/3 ")]))[0]


def test_a_turn_ends_once_and_nothing_follows_its_end() -> None:
    tracked = Tracked("s", "t", permission=False)
    assert ingest(tracked, _show("WAITING_FOR_INPUT", [("a", "/slow 3", "interrupted")], [("a", "1/3 ")])) == []
    late = ingest(tracked, _show("WAITING_FOR_INPUT", [("a", "/slow 3", "end_turn")], [("a", "2/3 ")], cursor=1))
    assert any("ended twice: interrupted, then end_turn" in p for p in late)
    assert any("after it ended interrupted" in p for p in late)


def test_orphans_liveness_permissions_and_the_board() -> None:
    procs = [{"pid": 10, "pgid": 10, "state": "S", "unit": AGENTCTL_UNIT, "mock": False},
             {"pid": 50, "pgid": 50, "state": "S", "unit": AGENTCTL_UNIT, "mock": True},
             {"pid": 60, "pgid": 60, "state": "S", "unit": AGENTCTL_UNIT, "mock": True}]
    status = {"control_server": {"pid": 10}}
    shows = {"s": _show("WAITING_FOR_INPUT", [("a", "/permission", "interrupted")], [],
                        permissions=[{"request_id": "r", "state": "open"}])}
    tasks = [{"task_id": "t", "state": "in_progress", "latest_session": {"session_id": "s"}}]
    found = unsettled(status, tasks, {"needs_attention": ["t"], "turn_finished": []}, shows, procs)
    assert found["orphans"] == [f"process groups [60] in {AGENTCTL_UNIT} belong to no live session"]
    assert "open permission request while WAITING_FOR_INPUT" in found["truthful"][0]
    assert "expected turn_finished" in found["board"][0]
    procs[1]["state"] = "Z"  # the agent is gone, the session still says live
    found = unsettled(status, tasks, {"needs_attention": ["t"]}, shows, procs[:2])
    assert "shows live=True but its agent 50 does not run" in found["truthful"][0] and found["board"] == []
