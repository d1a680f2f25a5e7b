"""First use of a managed npm runtime: prepare it, then start the agent.

Starting (or resuming) a session of a managed npm agent (claude-code, codex, gemini, opencode)
whose pinned runtime is not prepared in the npm cache (``daemon.runtimes.launch.prepared_runtime``)
runs the runtime job first, exactly the job ``kandev runtime update AGENT`` runs
(``daemon.runtimes.update``: stage the pinned spec, repair once, ACP-probe it); a job already
running for that agent is joined. Meanwhile the session is STARTING and its metadata carries
``runtime_prepare`` = ``{job_id, agent, spec, state, message, at}``, updated at each step of the
job, which ``session show`` shows. Everything here awaits (the job runs as the backend's task; the
file checks run in a worker thread): the event loop never blocks. A job that fails ends the
launch with ``runtime_not_prepared`` and the job's own explanation.

``op_runtime_ensure`` is the same for the CLI before it starts a session: prepared, or the job to
follow (``kandev session start`` prints its steps as ``kandev runtime update`` does).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from daemon.agents.registry import BUILTIN_AGENTS, BuiltinAgent
from daemon.runtimes.launch import RUNTIME_NOT_PREPARED, RuntimeNotPrepared, find_prepared
from daemon.runtimes.update import MAX_WAIT_S, TERMINAL, Job, RuntimeJobs
from daemon.store.models import TaskSession
from daemon.store.session_metadata import SessionMetadata
from ipc.errors import ErrorCode, IpcError

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext as Backend

PROGRESS_KEY = "runtime_prepare"


def _check(agent: BuiltinAgent) -> str | None:
    """None when the runtime is prepared, else why not (blocking): what is wrong, without the fix
    by hand (a runtime job is about to prepare it)."""
    try:
        find_prepared(agent)
    except RuntimeNotPrepared as exc:
        return exc.what
    return None


async def missing(agent: BuiltinAgent) -> str | None:
    """Why ``agent``'s runtime is not ready (None: ready, or not an npm runtime)."""
    if agent.runtime != "npm":
        return None
    return await asyncio.to_thread(_check, agent)


def _jobs(backend: Backend) -> RuntimeJobs:
    jobs = backend.runtime_jobs
    if jobs is None:  # handlers() not built yet: nothing can prepare a runtime
        raise IpcError(ErrorCode.UNAVAILABLE, "the backend is not ready to prepare runtimes; retry shortly", True)
    return jobs


def _progress(job: Job) -> dict[str, Any]:
    last = job.events[-1]["message"] if job.events else None
    return {"job_id": job.job_id, "agent": job.agent, "spec": job.spec, "state": job.state, "message": last,
            "detail": job.detail, "at": datetime.now(UTC).isoformat(timespec="milliseconds")}


def _record(backend: Backend, session_id: str | None, job: Job) -> None:
    if session_id is None:
        return
    with backend.store.session() as db:
        session = db.get(TaskSession, session_id)
        if session is None:
            return
        meta = SessionMetadata.load(session)
        meta.set_runtime_prepare(_progress(job))
        meta.save(session)


async def ensure(backend: Backend, agent: BuiltinAgent, session_id: str | None = None) -> Job | None:
    """Return once ``agent``'s runtime is prepared, running (or joining) its runtime job first if
    it is not; the job (None if none was needed). ``runtime_not_prepared`` when the job fails."""
    why = await missing(agent)
    if why is None:
        return None
    jobs = _jobs(backend)
    job, _joined = jobs.request(agent.name)
    _record(backend, session_id, job)
    while job.state not in TERMINAL:
        job = await jobs.wait(job.job_id, after=len(job.events), timeout=MAX_WAIT_S)
        _record(backend, session_id, job)
    if job.state != "succeeded":
        raise IpcError(RUNTIME_NOT_PREPARED, f"preparing the runtime of {agent.name} ({agent.npm_spec}) failed"
                       f" (runtime job {job.job_id}): {job.detail}; `kandev runtime update {agent.name}` tries again",
                       retryable=False)
    why = await missing(agent)
    if why is not None:
        raise IpcError(RUNTIME_NOT_PREPARED, f"the runtime job {job.job_id} succeeded, yet: {why}", retryable=False)
    return job


async def op_runtime_ensure(backend: Backend, agent_name: str) -> dict[str, Any]:
    """``{agent, prepared: true, job: None}``, or ``{agent, prepared: false, job}`` with the runtime
    job started (or joined) to prepare it (follow it with ``runtime_job``)."""
    agent = BUILTIN_AGENTS.get(agent_name)
    if agent is None:
        known = ", ".join(sorted(BUILTIN_AGENTS))
        raise IpcError(ErrorCode.INVALID_ARGUMENT, f"unknown agent {agent_name!r:.100}; built-in agents: {known}")
    why = await missing(agent)
    if why is None:
        return {"agent": agent.name, "prepared": True, "job": None}
    job, joined = _jobs(backend).request(agent.name)
    return {"agent": agent.name, "prepared": False, "reason": why, "job": {**job.to_dict(), "joined": joined}}
