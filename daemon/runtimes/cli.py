"""``kandev runtime update AGENT``: start (or join) the backend's update job and follow it.

Every step of the job (each state change, the repair) is printed to stderr as it
happens, by long-polling ``runtime_job``; the return value is the final object
``{attempts, repaired, probe{ok, protocol_version}, state, detail, ...}`` that
``--json`` prints. The command exits 1 when the job ended ``failed``.

``ensure_runtime`` is what ``kandev session start`` and ``kandev resume`` do first for a managed
npm agent: nothing when its runtime is prepared, else follow the job that prepares it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from daemon.runtimes.update import MAX_WAIT_S, TERMINAL
from ipc.errors import ErrorCode, IpcError

Call = Callable[[str, dict[str, Any], float], Any]
POLL_WAIT_S = 10.0


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


def _follow(call: Call, job: dict[str, Any], progress: TextIO, poll_wait: float, label: str) -> dict[str, Any]:
    shown = 0
    wait = min(poll_wait, MAX_WAIT_S)
    while True:
        events = job.get("events") or []
        for event in events[shown:]:
            print(f"kandev: {label}: [{event.get('state')}] {event.get('message')}", file=progress, flush=True)
        shown = max(shown, len(events))
        if job["state"] in TERMINAL:
            return final(job)
        job = call("runtime_job", {"job_id": job["job_id"], "after": shown, "wait": wait}, wait + 30.0)


def runtime_update(call: Call, agent: str, progress: TextIO, poll_wait: float = POLL_WAIT_S) -> dict[str, Any]:
    job = call("runtime_update", {"agent": agent}, 30.0)
    if job.get("joined"):
        print(f"kandev: runtime update {agent}: joining the job already running ({job['job_id']})", file=progress)
    return _follow(call, job, progress, poll_wait, f"runtime update {agent}")


def ensure_runtime(call: Call, agent: str, progress: TextIO, poll_wait: float = POLL_WAIT_S) -> dict[str, Any] | None:
    """Before a session of ``agent`` starts: nothing if its runtime is prepared (or it has none);
    else follow the runtime job the backend started (or joined) to prepare it, each step on
    ``progress``. Returns the finished job; IpcError ``runtime_not_prepared`` if it failed."""
    try:
        answer = call("runtime_ensure", {"agent": agent}, 30.0)
    except IpcError as exc:
        if exc.code == ErrorCode.UNKNOWN_OP:  # an older backend: it starts the agent as it always did
            return None
        raise
    if answer.get("prepared") or not answer.get("job"):
        return None
    # what is wrong, then what happens now: no instruction for the user, since nothing is left to them
    print(f"kandev: the runtime of {agent} is not prepared yet: {answer.get('reason')}.\n"
          f"kandev: preparing it now (as `kandev runtime update {agent}` does), then starting the session:",
          file=progress, flush=True)
    job = _follow(call, answer["job"], progress, poll_wait, f"preparing {agent}")
    if job["state"] != "succeeded":
        raise IpcError(ErrorCode.RUNTIME_NOT_PREPARED, f"preparing the runtime of {agent} failed (runtime job"
                       f" {job['job_id']}): {job.get('detail')}; `kandev runtime update {agent}` tries again")
    return job
