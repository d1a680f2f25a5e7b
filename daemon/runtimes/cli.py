"""``kandev runtime update AGENT``: start (or join) the backend's update job and follow it.

Every step of the job (each state change, the repair) is printed to stderr as it
happens, by long-polling ``runtime_job``; the return value is the final object
``{attempts, repaired, probe{ok, protocol_version}, state, detail, ...}`` that
``--json`` prints. The command exits 1 when the job ended ``failed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from daemon.runtimes.update import MAX_WAIT_S, TERMINAL

Call = Callable[[str, dict[str, Any], float], Any]
POLL_WAIT_S = 10.0


def _line(agent: str, event: dict[str, Any]) -> str:
    return f"kandev: runtime update {agent}: [{event.get('state')}] {event.get('message')}"


def final(job: dict[str, Any]) -> dict[str, Any]:
    probe = job.get("probe") or {}
    return {
        "job_id": job["job_id"],
        "agent": job["agent"],
        "package": job.get("package"),
        "version": job.get("version"),
        "state": job["state"],
        "attempts": job["attempts"],
        "repaired": job["repaired"],
        "repair": job.get("repair"),
        "probe": {
            "ok": bool(probe.get("ok")),
            "protocol_version": probe.get("protocol_version"),
            "agent_name": probe.get("agent_name"),
            "agent_version": probe.get("agent_version"),
        },
        "detail": job.get("detail"),
    }


def runtime_update(call: Call, agent: str, progress: TextIO, poll_wait: float = POLL_WAIT_S) -> dict[str, Any]:
    job = call("runtime_update", {"agent": agent}, 30.0)
    if job.get("joined"):
        print(f"kandev: runtime update {agent}: joining the job already running ({job['job_id']})", file=progress)
    shown = 0
    wait = min(poll_wait, MAX_WAIT_S)
    while True:
        events = job.get("events") or []
        for event in events[shown:]:
            print(_line(agent, event), file=progress, flush=True)
        shown = max(shown, len(events))
        if job["state"] in TERMINAL:
            return final(job)
        job = call("runtime_job", {"job_id": job["job_id"], "after": shown, "wait": wait}, wait + 30.0)
