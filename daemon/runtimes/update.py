"""The managed-runtime update job (RESUME-11, RESUME-12, RESUME-13, NPM-CTX-3) and the backend's job manager.

One job updates one built-in npm agent to its pinned exact spec
``<package>@<version>`` and moves through::

    queued -> resolving -> updating -> refreshing -> succeeded
                  |            |    \\-> (attempt 1 failed: repair) -> updating -> refreshing -> succeeded
                  v            v                                          |           |
                failed       failed <-------------------------------------+-----------+

- *resolving*: the agent must be a built-in managed npm runtime; the npm cache root
  comes from ``npm config get cache`` (direct argv) and is checked
  (``npx_cache.check_cache_root``); the ``_npx`` key of the exact spec is computed.
- *updating*: ``npm exec --yes --prefer-online --package=<pkg>@<ver> -- node -e ""``
  prepares the spec in its version-specific ``_npx`` tree (bounded time).
- *refreshing*: the ACP ``initialize`` probe of the candidate, started as a launch
  starts it (``probe.acp_probe``). Success is declared only here.

An attempt is *updating* plus *refreshing*. After the **first** failed attempt
(the staging command failed, or the probe did not pass: a tree npm considers
installed can still be broken, e.g. a truncated entry script), and only then,
the job removes exactly ``<cache>/_npx/<key>`` of that spec
(``npx_cache.remove_npx_entry``) and retries **once**. A second failure, or a
refused or failed repair, ends the job ``failed`` with a bounded, sanitized
detail; nothing more is deleted and nothing is retried (RESUME-13).

Every command of a job (npm and the probe) runs as the job's *confinement* says
(``RuntimeJobs(confinement=...)``): the backend gives each job a sandbox of its own whose only
way out is a proxy to npm's registry (``daemon.backend.sessions.runtime_sandbox``); a refusal of
that proxy is one more event of the job. Without one (the unit tests, ``agents.sandbox = "off"``)
commands run as they are.

Jobs are stored in ``runtime_update_jobs`` (state, attempts; ``detail`` holds a
JSON object: the human-readable ``message`` plus the structured result, so a job
can be shown after the backend restarted). Jobs for one agent are idempotent
while active: a second request returns the active job. A job still active when
its backend stopped is marked ``failed`` (interrupted) by the next backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from daemon.agents.registry import BUILTIN_AGENTS, BuiltinAgent
from daemon.core.journal import log_event
from daemon.runtimes.npx_cache import (
    NPX_DIR,
    RepairRefused,
    RepairResult,
    check_cache_root,
    npx_key,
    remove_npx_entry,
    trusted_spec,
)
from daemon.runtimes.probe import ProbeResult, acp_probe
from daemon.runtimes.proc import DETAIL_LIMIT, CommandRunner, Confine, ConfineError, RunResult, sanitize
from daemon.store.models import RuntimeUpdateJob
from ipc.aio import within
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger(__name__)

STATES = ("queued", "resolving", "updating", "refreshing", "succeeded", "failed")
ACTIVE = frozenset(("queued", "resolving", "updating", "refreshing"))
TERMINAL = frozenset(("succeeded", "failed"))
MAX_ATTEMPTS = 2  # the first attempt and the one retry after the repair

CONFIG_TIMEOUT_S = 30.0  # npm config get cache
STAGE_TIMEOUT_S = 300.0  # npm exec --prefer-online (a cold install of the largest agent included)
PROBE_TIMEOUT_S = 60.0  # start through npx --prefer-offline and answer initialize
MAX_WAIT_S = 30.0  # longest long-poll of the job-status op
INTERRUPTED = "interrupted: the backend stopped before the job ended"


def stage_argv(spec: str) -> list[str]:
    """The staging command (NPM-CTX-3): prepare ``spec`` online, run nothing of it."""
    return ["npm", "exec", "--yes", "--prefer-online", f"--package={spec}", "--", "node", "-e", ""]


CACHE_ARGV = ("npm", "config", "get", "cache")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _no_probe() -> dict[str, Any]:
    return {"ok": False, "protocol_version": None}


@dataclass
class Job:
    job_id: str
    agent: str
    package: str
    version: str
    state: str = "queued"
    attempts: int = 0
    repaired: bool = False  # the targeted _npx invalidation ran
    repair: dict[str, Any] | None = None  # {path, removed}
    probe: dict[str, Any] = field(default_factory=_no_probe)
    detail: str | None = None
    cache_root: str | None = None
    npx_entry: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "agent": self.agent,
            "package": self.package,
            "version": self.version,
            "state": self.state,
            "attempts": self.attempts,
            "repaired": self.repaired,
            "repair": self.repair,
            "probe": dict(self.probe),
            "detail": self.detail,
            "cache_root": self.cache_root,
            "npx_entry": self.npx_entry,
            "events": [dict(e) for e in self.events],
        }

    def stored_detail(self) -> str:
        """What ``runtime_update_jobs.detail`` holds."""
        data = self.to_dict()
        for key in ("job_id", "agent", "state", "attempts", "detail"):
            data.pop(key)
        data["message"] = self.detail
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_row(cls, row: RuntimeUpdateJob) -> Job:
        try:
            data = json.loads(row.detail or "{}")
            if not isinstance(data, dict):
                raise ValueError
        except ValueError:
            data = {"message": row.detail}
        agent = BUILTIN_AGENTS.get(row.agent)
        return cls(
            job_id=row.id,
            agent=row.agent,
            package=str(data.get("package") or (agent.package if agent else "")),
            version=str(data.get("version") or (agent.version if agent else "")),
            state=row.state,
            attempts=int(row.attempts or 0),
            repaired=bool(data.get("repaired", False)),
            repair=data.get("repair"),
            probe=data.get("probe") or _no_probe(),
            detail=data.get("message"),
            cache_root=data.get("cache_root"),
            npx_entry=data.get("npx_entry"),
            events=list(data.get("events") or []),
        )


class Runner(Protocol):
    async def run(self, argv: Sequence[str], timeout: float) -> RunResult: ...


ProbeFn = Callable[[Sequence[str], float], Awaitable[ProbeResult]]
RemoveFn = Callable[[Path, str, str], RepairResult]
Confinement = Callable[[Job, Mapping[str, str], Callable[[str], None]], AbstractAsyncContextManager[Confine | None]]
"""``(job, env, note) -> async context of the job's Confine``: opened before the job's first command,
closed after its last; ``note`` adds a line to the job's events (a refused destination).
ConfineError when the job cannot be confined (the job then fails, saying why)."""


@contextlib.asynccontextmanager
async def unconfined(job: Job, env: Mapping[str, str], note: Callable[[str], None]) -> AsyncIterator[Confine | None]:
    """The confinement of nothing: every command runs as it is."""
    yield None


class _Finished(Exception):
    pass


class RuntimeUpdater:
    """Runs one job through its states. npm, the probe and the removal are injected (tests fake npm)."""

    def __init__(
        self,
        runner: Runner,
        probe: ProbeFn,
        *,
        on_change: Callable[[Job], None] = lambda job: None,
        remove_entry: RemoveFn = remove_npx_entry,
        config_timeout: float = CONFIG_TIMEOUT_S,
        stage_timeout: float = STAGE_TIMEOUT_S,
        probe_timeout: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.runner = runner
        self.probe = probe
        self.on_change = on_change
        self.remove_entry = remove_entry
        self.config_timeout = config_timeout
        self.stage_timeout = stage_timeout
        self.probe_timeout = probe_timeout

    # -------------------------------------------------------------- recording
    def _event(self, job: Job, message: str) -> None:
        job.events.append(
            {"seq": len(job.events) + 1, "state": job.state, "attempt": job.attempts,
             "message": sanitize(message, 600).replace("\n", " | "), "at": _now()}
        )
        self.on_change(job)

    def _set(self, job: Job, state: str, message: str) -> None:
        assert state in STATES
        job.state = state
        log_event(
            "runtime_update", f"runtime update {job.job_id} ({job.agent}): {state}: {sanitize(message, 300)}",
            priority=3 if state == "failed" else 6,
            JOB_ID=job.job_id, AGENT=job.agent, STATE=state, ATTEMPT=job.attempts, SPEC=job.spec,
        )
        self._event(job, message)

    def _finish(self, job: Job, state: str, detail: str) -> None:
        job.detail = sanitize(detail, DETAIL_LIMIT)
        self._set(job, state, job.detail)
        raise _Finished

    # -------------------------------------------------------------- the job
    async def run(self, job: Job) -> Job:
        try:
            await self._run(job)
        except _Finished:
            pass
        except asyncio.CancelledError:
            with contextlib.suppress(_Finished):
                self._finish(job, "failed", INTERRUPTED)
            raise
        except Exception as exc:  # a bug here must still end the job
            log.exception("runtime update %s failed", job.job_id)
            with contextlib.suppress(_Finished):
                self._finish(job, "failed", f"internal error: {type(exc).__name__}: {exc}")
        return job

    def _trusted_agent(self, job: Job) -> BuiltinAgent:
        agent = BUILTIN_AGENTS.get(job.agent)
        if agent is None or agent.runtime != "npm" or (agent.package, agent.version) != (job.package, job.version):
            self._finish(job, "failed", f"{job.agent!r} is not a built-in managed npm runtime")
        assert agent is not None
        try:
            trusted_spec(agent.package, agent.version)
        except RepairRefused as exc:
            self._finish(job, "failed", str(exc))
        return agent

    async def _run(self, job: Job) -> None:
        self._set(job, "resolving", f"{job.spec}: asking npm for its cache directory")
        agent = self._trusted_agent(job)
        spec = agent.npm_spec
        key = npx_key(spec)
        cfg = await self.runner.run(CACHE_ARGV, self.config_timeout)
        if not cfg.ok:
            self._finish(job, "failed", f"cannot ask npm for its cache directory: {cfg.failure()}")
        try:
            root = check_cache_root(cfg.stdout)
        except RepairRefused as exc:
            self._finish(job, "failed", f"refusing the npm cache directory: {exc}")
        job.cache_root = str(root)
        job.npx_entry = str(root / NPX_DIR / key)
        self._event(job, f"npm cache {root}; {spec} is prepared in {NPX_DIR}/{key}")
        failures: list[str] = []
        while True:
            job.attempts += 1
            self._set(job, "updating", f"attempt {job.attempts}/{MAX_ATTEMPTS}: preparing {spec} (npm exec --prefer-online)")
            staged = await self.runner.run(stage_argv(spec), self.stage_timeout)
            if staged.ok:
                self._set(job, "refreshing", f"attempt {job.attempts}/{MAX_ATTEMPTS}: ACP initialize probe of {spec}")
                probed = await self.probe(agent.argv(), self.probe_timeout)
                job.probe = {
                    "ok": probed.ok,
                    "protocol_version": probed.protocol_version,
                    "agent_name": probed.agent_name,
                    "agent_version": probed.agent_version,
                    "duration_s": probed.duration_s,
                }
                if probed.ok:
                    self._finish(
                        job, "succeeded",
                        f"{spec} is ready: ACP protocol version {probed.protocol_version}"
                        + (f" ({probed.agent_name} {probed.agent_version})" if probed.agent_name else "")
                        + (f" after repairing {NPX_DIR}/{key}" if job.repaired else ""),
                    )
                failure = f"the ACP probe failed: {probed.detail}"
            else:
                failure = f"preparing {spec} failed: {staged.failure()}"
            failures.append(failure)
            if job.attempts >= MAX_ATTEMPTS:
                first = sanitize(failures[0], 400)
                self._finish(
                    job, "failed",
                    f"attempt {job.attempts} after repairing {NPX_DIR}/{key} failed: {failure} "
                    f"(attempt 1: {first}); no further retry or deletion",
                )
            # The first failure, and only it, allows the targeted repair (RESUME-11).
            self._event(job, f"attempt {job.attempts} failed: {sanitize(failure, 400)}; invalidating {NPX_DIR}/{key}")
            try:
                result = self.remove_entry(root, agent.package, agent.version)
            except RepairRefused as exc:
                self._finish(job, "failed", f"{failure}; the repair was refused: {exc}")
            except OSError as exc:
                self._finish(job, "failed", f"{failure}; the repair failed: {exc}")
            job.repaired = True
            job.repair = {"path": result.path, "removed": result.removed}
            self._event(job, f"removed {result.path}" if result.removed else f"nothing to remove at {result.path}")


class RuntimeJobs:
    """The backend's update jobs: stored, idempotent per agent while active, observable by long-poll."""

    def __init__(
        self,
        store: Any,
        workdir: Path,
        *,
        env: Mapping[str, str] | None = None,
        updater_factory: Callable[[RuntimeJobs, Confine | None], RuntimeUpdater] | None = None,
        confinement: Confinement = unconfined,
        host: str | None = None,
    ) -> None:
        self.host = host  # this backend's cluster host (its jobs only); None: a single host
        self.store = store
        self.workdir = Path(workdir)
        self.env = dict(os.environ if env is None else env)
        for name, value in (("npm_config_update_notifier", "false"), ("npm_config_fund", "false"),
                            ("npm_config_audit", "false")):
            self.env.setdefault(name, value)
        self.jobs: dict[str, Job] = {}
        self.tasks: dict[str, asyncio.Task[Job]] = {}
        self._wakeups: dict[str, asyncio.Event] = {}
        self._updater_factory = updater_factory or RuntimeJobs.default_updater
        self._confinement = confinement

    # ----------------------------------------------------------- construction
    @staticmethod
    def default_updater(jobs: RuntimeJobs, confine: Confine | None = None) -> RuntimeUpdater:
        runner = CommandRunner(jobs.workdir, jobs.env, confine=confine)

        async def probe(argv: Sequence[str], timeout: float) -> ProbeResult:
            return await acp_probe(argv, cwd=jobs.workdir, env=jobs.env, timeout=timeout, confine=confine)

        return RuntimeUpdater(runner, probe, on_change=jobs._changed)

    def prepare_workdir(self) -> None:
        """A neutral directory for npm: no project, no project ``.npmrc`` (NPM-CTX-6), its own ``package.json``
        so npm never looks further up for a project."""
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker = self.workdir / "package.json"
        if not marker.exists():
            marker.write_text('{"name": "kandev-runtime-work", "private": true}\n')

    def sweep_interrupted(self) -> int:
        """Mark jobs a previous backend of this host left active as failed; returns how many."""
        count = 0
        with self.store.session() as db:
            rows = db.query(RuntimeUpdateJob).filter(RuntimeUpdateJob.state.in_(sorted(ACTIVE)),
                                                     *([RuntimeUpdateJob.host == self.host] if self.host else [])).all()
            for row in rows:
                if row.id in self.jobs:
                    continue
                job = Job.from_row(row)
                job.state = "failed"
                job.detail = INTERRUPTED
                job.events.append({"seq": len(job.events) + 1, "state": "failed", "attempt": job.attempts,
                                   "message": INTERRUPTED, "at": _now()})
                row.state = "failed"
                row.detail = job.stored_detail()
                row.updated_at = datetime.now(UTC)
                count += 1
        if count:
            log_event("runtime_update", f"{count} runtime update job(s) interrupted by a backend stop marked failed",
                      priority=4, STATE="failed")
        return count

    # ------------------------------------------------------------ requests
    def request(self, agent_name: str) -> tuple[Job, bool]:
        """Start the update job of ``agent_name``, or return its active job: ``(job, joined)``."""
        agent = BUILTIN_AGENTS.get(agent_name)
        managed = sorted(a.name for a in BUILTIN_AGENTS.values() if a.runtime == "npm")
        if agent is None or agent.runtime != "npm":
            what = "an unknown agent" if agent is None else "not a managed npm runtime"
            raise IpcError(
                ErrorCode.INVALID_ARGUMENT,
                f"{agent_name!r:.100} is {what}; managed npm runtimes: {', '.join(managed)}",
            )
        for job in self.jobs.values():
            if job.agent == agent_name and job.state in ACTIVE:
                return job, True
        job = Job(job_id=uuid.uuid4().hex, agent=agent.name, package=agent.package, version=agent.version)
        job.events.append({"seq": 1, "state": "queued", "attempt": 0, "message": f"queued: {job.spec}",
                           "at": _now()})
        with self.store.session() as db:
            db.add(RuntimeUpdateJob(id=job.job_id, agent=job.agent, state=job.state, attempts=0,
                                    detail=job.stored_detail(), host=self.host))
        self.jobs[job.job_id] = job
        self.tasks[job.job_id] = asyncio.get_running_loop().create_task(
            self._run(job), name=f"runtime-update-{job.agent}"
        )
        log_event("runtime_update", f"runtime update {job.job_id} ({job.agent}): queued {job.spec}",
                  JOB_ID=job.job_id, AGENT=job.agent, STATE="queued", SPEC=job.spec)
        return job, False

    def _note(self, job: Job, message: str) -> None:
        """One more event of ``job`` in its current state (a refusal of its proxy)."""
        job.events.append({"seq": len(job.events) + 1, "state": job.state, "attempt": job.attempts,
                           "message": sanitize(message, 600).replace("\n", " | "), "at": _now()})
        self._changed(job)

    def _fail(self, job: Job, detail: str) -> Job:
        job.state, job.detail = "failed", sanitize(detail)
        job.events.append({"seq": len(job.events) + 1, "state": "failed", "attempt": job.attempts,
                           "message": job.detail, "at": _now()})
        log_event("runtime_update", f"runtime update {job.job_id} ({job.agent}): failed: {job.detail}", priority=3,
                  JOB_ID=job.job_id, AGENT=job.agent, STATE="failed", ATTEMPT=job.attempts, SPEC=job.spec)
        self._changed(job)
        return job

    async def _run(self, job: Job) -> Job:
        try:
            try:
                self.prepare_workdir()
            except OSError as exc:
                return self._fail(job, f"cannot prepare {self.workdir}: {exc}")
            try:
                async with self._confinement(job, self.env, lambda line: self._note(job, line)) as confine:
                    return await self._updater_factory(self, confine).run(job)
            except ConfineError as exc:
                return self._fail(job, f"cannot prepare {job.spec} in its sandbox: {exc}")
        finally:
            self.tasks.pop(job.job_id, None)

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is not None:
            return job
        with self.store.session() as db:
            row = db.get(RuntimeUpdateJob, job_id)
            if row is None:
                raise IpcError(ErrorCode.NOT_FOUND, f"no runtime update job with id {job_id!r:.100}")
            return Job.from_row(row)

    async def wait(self, job_id: str, after: int = 0, timeout: float = 0.0) -> Job:
        """The job once it has more than ``after`` events or has ended, or at ``timeout`` seconds."""
        job = self.get(job_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, min(float(timeout), MAX_WAIT_S))
        while len(job.events) <= after and job.state not in TERMINAL:
            remaining = deadline - loop.time()
            if remaining <= 0 or job.job_id not in self.jobs:
                break
            wakeup = self._wakeups.setdefault(job.job_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await within(wakeup.wait(), remaining)
            job = self.get(job_id)
        return job

    def _changed(self, job: Job) -> None:
        """Persist the job's state, then wake its long-polls."""
        try:
            with self.store.session() as db:
                row = db.get(RuntimeUpdateJob, job.job_id)
                if row is None:
                    row = RuntimeUpdateJob(id=job.job_id, agent=job.agent, host=self.host)
                    db.add(row)
                row.state = job.state
                row.attempts = job.attempts
                row.detail = job.stored_detail()
                row.updated_at = datetime.now(UTC)
        except Exception:  # the job goes on; its state is still served from memory
            log.exception("cannot store runtime update job %s", job.job_id)
        wakeup = self._wakeups.pop(job.job_id, None)
        if wakeup is not None:
            wakeup.set()

    async def close(self) -> None:
        """Stop every running job (each ends ``failed``, interrupted, with its processes stopped)."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for job in self.jobs.values():  # cancelled before its first step ran
            if job.state in ACTIVE:
                job.state, job.detail = "failed", INTERRUPTED
                job.events.append({"seq": len(job.events) + 1, "state": "failed", "attempt": job.attempts,
                                   "message": INTERRUPTED, "at": _now()})
                self._changed(job)
