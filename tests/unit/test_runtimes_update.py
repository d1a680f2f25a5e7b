"""The runtime update job's state machine with a fake npm (RESUME-11, RESUME-12, RESUME-13, NPM-CTX-3).

npm and the ACP probe are fakes that record what they were asked; the removal is
the real ``remove_npx_entry`` working on a fake cache under ``tmp_path``, so the
tests see exactly which directories the job deletes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.agents.registry import BUILTIN_AGENTS
from daemon.runtimes import update as upd
from daemon.runtimes.cli import runtime_update
from daemon.runtimes.npx_cache import npx_key
from daemon.runtimes.probe import ProbeResult
from daemon.runtimes.proc import ConfineError, RunResult, sanitize
from daemon.runtimes.update import Job, RuntimeJobs, RuntimeUpdater, stage_argv
from daemon.store.db import Store
from daemon.store.models import RuntimeUpdateJob
from ipc.errors import IpcError
from tests.support.aio import run
from tests.support.waiting import eventually

CLAUDE = BUILTIN_AGENTS["claude-code"]
KEY = npx_key(CLAUDE.npm_spec)
OK_PROBE = ProbeResult(True, 1, "@zed-industries/claude-code-acp", "0.16.2", "", 0.5)
SECRET = "npm_SuperSecretToken1234567890"


def ok(argv: Sequence[str], stdout: str = "") -> RunResult:
    return RunResult(tuple(argv), 0, stdout, "", False, 0.1)


def failed(argv: Sequence[str], stderr: str, code: int = 1) -> RunResult:
    return RunResult(tuple(argv), code, "", stderr, False, 0.1)


class FakeNpm:
    """``npm config get cache`` answers the fake cache; staging answers from a script."""

    def __init__(self, cache: Path | None, stages: list[str] | None = None, config: RunResult | None = None):
        self.cache = cache
        self.stages = list(stages or [])  # "ok" | "fail" | "timeout" per staging call
        self.config = config
        self.calls: list[tuple[str, ...]] = []
        self.gate: asyncio.Event | None = None

    async def run(self, argv: Sequence[str], timeout: float) -> RunResult:
        self.calls.append(tuple(argv))
        if tuple(argv) == upd.CACHE_ARGV:
            return self.config or ok(argv, f"{self.cache}\n")
        if self.gate is not None:
            await self.gate.wait()
        outcome = self.stages.pop(0) if self.stages else "ok"
        if outcome == "timeout":
            return RunResult(tuple(argv), None, "", "", True, timeout)
        if outcome == "fail":
            return failed(argv, "\x1b[31mnpm error\x1b[0m code EJSONPARSE\nnpm error JSON.parse Unexpected end "
                          f"of JSON input\nnpm error //registry.npmjs.org/:_authToken={SECRET}\n" + "x" * 5000)
        return ok(argv)

    @property
    def stage_calls(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c != upd.CACHE_ARGV]


class FakeProbe:
    def __init__(self, results: list[ProbeResult] | None = None):
        self.results = list(results or [])
        self.calls: list[list[str]] = []

    async def __call__(self, argv: Sequence[str], timeout: float) -> ProbeResult:
        self.calls.append(list(argv))
        return self.results.pop(0) if self.results else OK_PROBE


def fake_cache(tmp_path: Path) -> Path:
    root = tmp_path / "npm-cache"
    (root / "_npx" / KEY / "node_modules").mkdir(parents=True)
    (root / "_npx" / KEY / "package.json").write_text("")  # truncated
    (root / "_npx" / "0123456789abcdef").mkdir()
    (root / "_cacache").mkdir()
    return root


def new_job(agent: str = "claude-code") -> Job:
    a = BUILTIN_AGENTS[agent]
    return Job(job_id="j1", agent=a.name, package=a.package, version=a.version)


def states(job: Job) -> list[str]:
    seen: list[str] = []
    for e in job.events:
        if not seen or seen[-1] != e["state"]:
            seen.append(e["state"])
    return seen


def run_job(npm: FakeNpm, probe: FakeProbe, job: Job | None = None) -> Job:
    job = job or new_job()
    return run(RuntimeUpdater(npm, probe).run(job))


def test_success_on_first_attempt_deletes_nothing(tmp_path: Path) -> None:
    """RESUME-11: no deletion without a first failure; success only after the ACP probe."""
    cache = fake_cache(tmp_path)
    npm, probe = FakeNpm(cache), FakeProbe()
    job = run_job(npm, probe)
    assert job.state == "succeeded" and job.attempts == 1 and not job.repaired
    assert states(job) == ["resolving", "updating", "refreshing", "succeeded"]
    assert (cache / "_npx" / KEY).exists()
    assert npm.calls == [upd.CACHE_ARGV, tuple(stage_argv(CLAUDE.npm_spec))]
    assert npm.calls[1] == ("npm", "exec", "--yes", "--prefer-online",
                            "--package=@zed-industries/claude-code-acp@0.16.2", "--", "node", "-e", "")
    assert probe.calls == [CLAUDE.argv()]
    assert job.probe["ok"] is True and job.probe["protocol_version"] == 1
    assert job.cache_root == str(cache) and job.npx_entry == str(cache / "_npx" / KEY)


def test_first_staging_failure_repairs_that_entry_and_retries_once(tmp_path: Path) -> None:
    """RESUME-11, RESUME-12: after the first failure only _npx/<key> goes, then one retry, then the probe."""
    cache = fake_cache(tmp_path)
    npm, probe = FakeNpm(cache, ["fail", "ok"]), FakeProbe()
    job = run_job(npm, probe)
    assert job.state == "succeeded" and job.attempts == 2 and job.repaired
    assert job.repair == {"path": str(cache / "_npx" / KEY), "removed": True}
    assert not (cache / "_npx" / KEY).exists()
    assert (cache / "_npx" / "0123456789abcdef").exists() and (cache / "_cacache").exists()
    assert len(npm.stage_calls) == 2 and len(probe.calls) == 1
    assert states(job) == ["resolving", "updating", "refreshing", "succeeded"]
    assert [e["attempt"] for e in job.events if e["state"] == "refreshing"] == [2]
    assert "after repairing" in (job.detail or "")


def test_first_probe_failure_also_repairs_and_retries_once(tmp_path: Path) -> None:
    """A tree npm considers installed can be broken (truncated entry script): the probe catches it."""
    cache = fake_cache(tmp_path)
    npm = FakeNpm(cache)
    probe = FakeProbe([ProbeResult(False, detail="initialize failed: ConnectionError; exit code 1"), OK_PROBE])
    job = run_job(npm, probe)
    assert job.state == "succeeded" and job.attempts == 2 and job.repaired
    assert not (cache / "_npx" / KEY).exists()
    assert states(job) == ["resolving", "updating", "refreshing", "updating", "refreshing", "succeeded"]
    assert len(npm.stage_calls) == 2 and len(probe.calls) == 2


def test_second_failure_ends_failed_bounded_with_no_further_deletion(tmp_path: Path) -> None:
    """RESUME-13: bounded, sanitized failure; no third attempt; the repair ran exactly once."""
    cache = fake_cache(tmp_path)
    removals: list[tuple[Path, str, str]] = []
    from daemon.runtimes.npx_cache import remove_npx_entry

    def counting_remove(root: Path, package: str, version: str) -> Any:
        removals.append((root, package, version))
        return remove_npx_entry(root, package, version)

    npm, probe = FakeNpm(cache, ["fail", "fail", "ok", "ok"]), FakeProbe()
    job = run(RuntimeUpdater(npm, probe, remove_entry=counting_remove).run(new_job()))
    assert job.state == "failed" and job.attempts == 2 and job.repaired
    assert removals == [(cache, CLAUDE.package, CLAUDE.version)]
    assert len(npm.stage_calls) == 2 and probe.calls == []
    detail = job.detail or ""
    assert len(detail) <= 1500
    assert SECRET not in detail and "\x1b" not in detail and "<redacted>" in detail
    assert "EJSONPARSE" in detail and "no further retry or deletion" in detail
    assert SECRET not in json.dumps(job.to_dict())
    assert job.probe == {"ok": False, "protocol_version": None}
    assert (cache / "_npx" / "0123456789abcdef").exists()


def test_staging_timeout_counts_as_a_failure(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path)
    job = run_job(FakeNpm(cache, ["timeout", "timeout"]), FakeProbe())
    assert job.state == "failed" and job.attempts == 2 and "timed out" in (job.detail or "")


def test_probe_failing_twice_fails_the_job(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path)
    bad = ProbeResult(False, 2, "x", "1", "the agent speaks ACP protocol version 2, not 1")
    job = run_job(FakeNpm(cache), FakeProbe([bad, bad]))
    assert job.state == "failed" and job.attempts == 2
    assert job.probe["ok"] is False and job.probe["protocol_version"] == 2
    assert "protocol version 2" in (job.detail or "")


def test_npm_config_failure_ends_in_resolving_without_any_attempt(tmp_path: Path) -> None:
    npm = FakeNpm(None, config=RunResult(upd.CACHE_ARGV, None, "", "", False, 0.0, "cannot run npm: not found"))
    job = run_job(npm, FakeProbe())
    assert job.state == "failed" and job.attempts == 0 and npm.stage_calls == []
    assert states(job) == ["resolving", "failed"]
    assert "cannot run npm" in (job.detail or "")


def test_refused_cache_root_ends_the_job_before_any_attempt(tmp_path: Path) -> None:
    cache = fake_cache(tmp_path)
    link = tmp_path / "cache-link"
    link.symlink_to(cache)
    npm = FakeNpm(link, ["fail"])
    job = run_job(npm, FakeProbe())
    assert job.state == "failed" and npm.stage_calls == [] and "symlink" in (job.detail or "")
    assert (cache / "_npx" / KEY).exists()


def test_refused_repair_ends_the_job_without_retry(tmp_path: Path) -> None:
    """RESUME-13: the targeted repair failing ends the job; nothing broader is tried."""
    root = tmp_path / "cache"
    (root / "_npx").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "_npx" / KEY).symlink_to(outside)
    npm = FakeNpm(root, ["fail", "ok"])
    job = run_job(npm, FakeProbe())
    assert job.state == "failed" and job.attempts == 1 and len(npm.stage_calls) == 1
    assert "repair was refused" in (job.detail or "") and outside.exists()


def test_only_builtin_npm_agents_run(tmp_path: Path) -> None:
    npm = FakeNpm(fake_cache(tmp_path))
    job = Job(job_id="j", agent="claude-code", package="left-pad", version="1.3.0")  # not the built-in pair
    assert run_job(npm, FakeProbe(), job).state == "failed" and npm.calls == []
    mock = Job(job_id="m", agent="mock", package="daemon.agents.mock", version="0.1.0")
    assert run_job(npm, FakeProbe(), mock).state == "failed" and npm.calls == []


def test_sanitize_bounds_and_redacts() -> None:
    text = "\x1b[1mhead\x1b[0m https://user:pa55@registry.example/x Bearer abcdefghijklmnop _auth=zzz\r\n" + "y" * 9000
    out = sanitize(text, 300)
    assert len(out) <= 300 and "head" in out and out.endswith("y")
    assert "pa55" not in out and "abcdefghijklmnop" not in out and "zzz" not in out and "\x1b" not in out


# ------------------------------------------------------------------ the job manager


def manager(store: Store, tmp_path: Path, npm: FakeNpm, probe: FakeProbe) -> RuntimeJobs:
    def factory(jobs: RuntimeJobs, confine: object) -> RuntimeUpdater:
        return RuntimeUpdater(npm, probe, on_change=jobs._changed)

    return RuntimeJobs(store, tmp_path / "home" / "runtimes", env={}, updater_factory=factory)


def _confined_job(store: Store, tmp_path: Path, factory: Any, confinement: Any) -> Job:
    """One claude-code job run to its end by a manager with this updater factory and confinement."""

    async def scenario() -> Job:
        jobs = RuntimeJobs(store, tmp_path / "home" / "runtimes", env={}, updater_factory=factory,
                           confinement=confinement)
        job, _ = jobs.request("claude-code")
        return await jobs.tasks[job.job_id]

    return run(scenario())


def test_jobs_are_idempotent_per_agent_while_active(store: Store, tmp_path: Path) -> None:
    """NPM-CTX-3: a second request while queued or running returns the running job."""
    npm = FakeNpm(fake_cache(tmp_path))
    npm.gate = asyncio.Event()

    async def scenario() -> None:
        jobs = manager(store, tmp_path, npm, FakeProbe())
        first, joined = jobs.request("claude-code")
        assert not joined and first.state == "queued"
        await eventually(lambda: first.state != "queued", 10, interval=0.01, message="the job running")  # at the gate
        second, joined = jobs.request("claude-code")
        assert joined and second is first and first.state in upd.ACTIVE
        other, joined = jobs.request("gemini")  # other agents get their own job
        assert not joined and other.job_id != first.job_id
        npm.gate.set()
        done = await jobs.wait(first.job_id, after=0, timeout=5)
        while done.state not in upd.TERMINAL:
            done = await jobs.wait(first.job_id, after=len(done.events), timeout=5)
        assert done.state == "succeeded" and done.attempts == 1
        third, joined = jobs.request("claude-code")  # ended: a new request is a new job
        assert not joined and third.job_id != first.job_id
        await jobs.close()
        assert third.state == "failed" and third.detail == upd.INTERRUPTED

    run(scenario())
    with store.session() as db:
        rows = {r.id: r for r in db.query(RuntimeUpdateJob).all()}
    assert len(rows) == 3
    assert {r.state for r in rows.values()} <= {"succeeded", "failed"}
    assert (tmp_path / "home" / "runtimes" / "package.json").exists()


def test_unknown_and_unmanaged_agents_are_refused(store: Store, tmp_path: Path) -> None:
    async def scenario() -> None:
        jobs = manager(store, tmp_path, FakeNpm(None), FakeProbe())
        for name in ("mock", "nope", "../claude-code"):
            with pytest.raises(IpcError) as info:
                jobs.request(name)
            assert info.value.code == "invalid_argument"

    run(scenario())


def test_job_is_stored_and_readable_after_restart(store: Store, tmp_path: Path) -> None:
    npm = FakeNpm(fake_cache(tmp_path), ["fail", "ok"])

    async def scenario() -> str:
        jobs = manager(store, tmp_path, npm, FakeProbe())
        job, _ = jobs.request("claude-code")
        while job.state not in upd.TERMINAL:
            job = await jobs.wait(job.job_id, after=len(job.events), timeout=5)
        return job.job_id

    job_id = run(scenario())
    fresh = manager(store, tmp_path, npm, FakeProbe())  # a new backend: nothing in memory
    job = fresh.get(job_id)
    assert job.state == "succeeded" and job.attempts == 2 and job.repaired
    assert job.probe["protocol_version"] == 1 and job.repair and job.repair["removed"]
    with store.session() as db:
        row = db.get(RuntimeUpdateJob, job_id)
        assert row is not None and row.state == "succeeded" and row.attempts == 2
        assert json.loads(row.detail or "{}")["message"] == job.detail
    with pytest.raises(IpcError) as info:
        fresh.get("nope")
    assert info.value.code == "not_found"


def test_jobs_left_active_by_a_stopped_backend_are_marked_failed(store: Store, tmp_path: Path) -> None:
    with store.session() as db:
        db.add(RuntimeUpdateJob(id="old", agent="claude-code", state="updating", attempts=1, detail=None))
        db.add(RuntimeUpdateJob(id="done", agent="codex", state="succeeded", attempts=1, detail=None))
    jobs = manager(store, tmp_path, FakeNpm(None), FakeProbe())
    assert jobs.sweep_interrupted() == 1
    old = jobs.get("old")
    assert old.state == "failed" and old.detail == upd.INTERRUPTED and old.attempts == 1
    assert jobs.get("done").state == "succeeded"


def test_cli_prints_each_step_and_returns_the_final_object(store: Store, tmp_path: Path) -> None:
    """Progress on stderr while it runs; --json prints {attempts, repaired, probe{ok, protocol_version}, state, detail}."""
    npm = FakeNpm(fake_cache(tmp_path), ["fail", "ok"])

    async def scenario() -> tuple[dict[str, Any], str]:
        jobs = manager(store, tmp_path, npm, FakeProbe())
        from daemon.backend.handlers import runtimes as runtimes_api

        handlers = runtimes_api.handlers(SimpleNamespace(), jobs)  # type: ignore[arg-type]  # it keeps .runtime_jobs
        loop = asyncio.get_running_loop()
        progress = io.StringIO()

        def call(op: str, args: dict[str, Any], timeout: float) -> Any:
            return asyncio.run_coroutine_threadsafe(handlers[op](None, args), loop).result(timeout)  # type: ignore[arg-type]

        result = await asyncio.to_thread(runtime_update, call, "claude-code", progress, 2.0)
        return result, progress.getvalue()

    result, progress = run(scenario())
    assert {"attempts", "repaired", "probe", "state", "detail"} <= set(result)
    assert result["state"] == "succeeded" and result["attempts"] == 2 and result["repaired"] is True
    assert result["probe"]["ok"] is True and result["probe"]["protocol_version"] == 1
    lines = progress.splitlines()
    tags = [line.split("[", 1)[1].split("]", 1)[0] for line in lines]
    assert tags[0] == "queued" and tags[-1] == "succeeded"
    for state in ("resolving", "updating", "refreshing"):
        assert state in tags
    assert len(lines) == len(set(lines))  # every step exactly once
    assert any("removed" in line and KEY in line for line in lines)


# ------------------------------------------------------------------ the job's confinement (Issue 44 item 3)


def test_a_job_runs_inside_its_confinement_and_its_notes_are_events(store: Store, tmp_path: Path) -> None:
    """Issue 44 item 3: the job's confinement is opened before its first command and closed after its
    last; its commands get the confinement's Confine; a note (a refusal of the job's proxy) is one
    more event of the job."""
    npm = FakeNpm(fake_cache(tmp_path), stages=["ok"])
    seen: dict[str, Any] = {}

    async def confine(argv: Sequence[str], env: Any) -> Any:
        raise AssertionError("the fake npm never runs a command")

    @contextlib.asynccontextmanager
    async def confinement(job: Job, env: Any, note: Any) -> Any:
        seen["open"] = job.state
        note("refused github.com:443: not in the allow-list")
        yield confine
        seen["closed"] = job.state

    def factory(jobs: RuntimeJobs, given: Any) -> RuntimeUpdater:
        seen["confine"] = given
        return RuntimeUpdater(npm, FakeProbe(), on_change=jobs._changed)

    job = _confined_job(store, tmp_path, factory, confinement)
    assert job.state == "succeeded", job.detail
    assert seen == {"open": "queued", "confine": confine, "closed": "succeeded"}
    assert any(e["message"] == "refused github.com:443: not in the allow-list" for e in job.events), job.events


def test_a_job_that_cannot_be_confined_fails_saying_why(store: Store, tmp_path: Path) -> None:
    """Issue 44 item 3: where the preparation's sandbox cannot be made, the job fails saying why
    and runs no npm at all."""
    npm = FakeNpm(fake_cache(tmp_path), stages=["ok"])

    @contextlib.asynccontextmanager
    async def confinement(job: Job, env: Any, note: Any) -> Any:
        raise ConfineError("the sandbox cannot be made here: no bwrap")
        yield None

    def factory(jobs: RuntimeJobs, given: Any) -> RuntimeUpdater:
        return RuntimeUpdater(npm, FakeProbe(), on_change=jobs._changed)

    job = _confined_job(store, tmp_path, factory, confinement)
    assert job.state == "failed" and npm.calls == []
    assert job.detail == f"cannot prepare {CLAUDE.npm_spec} in its sandbox: the sandbox cannot be made here: no bwrap"
    assert job.events[-1]["state"] == "failed"
