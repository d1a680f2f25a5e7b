"""Backend handlers of the managed npm runtime ops (``api.RUNTIME_OPS``; daemon/runtimes/update.py).

- ``runtime_update {agent}``: start the update job of a built-in managed npm agent,
  or join its active one (``joined: true``) -> the job.
- ``runtime_job {job_id, after?, wait?}``: the job; with ``wait`` (seconds, at most
  30) the answer comes once the job has more than ``after`` events or has ended,
  so ``kandev runtime update`` shows every step as it happens.
- ``runtime_ensure {agent}``: prepared already, or the job started (or joined) to
  prepare it (``daemon.backend.sessions.runtime_prepare``; ``kandev session start`` follows it).

npm runs with the backend's own npm configuration (its ``npm_config_*`` variables and
HOME decide the cache, NPM-CTX-5) in ``<home>/runtimes``, a neutral directory,
so a task repository's ``.npmrc`` never applies (NPM-CTX-6), and in a sandbox whose
only way out is npm's registry (``daemon.backend.sessions.runtime_sandbox``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from daemon.backend.sessions import runtime_prepare
from daemon.backend.sessions.runtime_sandbox import RuntimeSandbox
from daemon.runtimes.update import RuntimeJobs
from ipc.server import ConnectionContext

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext as Backend

Handler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]


def handlers(backend: Backend, jobs: RuntimeJobs | None = None) -> dict[str, Handler]:
    """The handler table for ``api.RUNTIME_OPS``; marks jobs a previous backend left active as failed."""
    if jobs is None:
        workdir = backend.paths.home / "runtimes"
        box = RuntimeSandbox(lambda: backend.config, backend.paths, workdir)
        box.prune()  # the proxy directories of jobs a previous backend left
        jobs = RuntimeJobs(backend.store, workdir, confinement=box.confinement, host=backend.cluster.identity.host)
    jobs.sweep_interrupted()
    backend.runtime_jobs = jobs  # a session start of an unprepared runtime runs its job first

    async def op_runtime_update(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        job, joined = jobs.request(args["agent"])
        return {**job.to_dict(), "joined": joined}

    async def op_runtime_job(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        job = await jobs.wait(args["job_id"], int(args.get("after", 0)), float(args.get("wait", 0.0)))
        return job.to_dict()

    async def op_runtime_ensure(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await runtime_prepare.op_runtime_ensure(backend, args["agent"])

    return {"runtime_update": op_runtime_update, "runtime_job": op_runtime_job, "runtime_ensure": op_runtime_ensure}
