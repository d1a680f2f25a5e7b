"""The real npm agents for the tests (Issue 12, Issue 22): each prepared once, shared by every test.

``prepare_cache(name)`` gives an npm cache directory under /var/tmp, named after the agent's
pinned spec, in which that built-in agent's package (``claude-code``'s
``@zed-industries/claude-code-acp``, ``opencode``'s ``opencode-ai``, ``codex``'s
``@agentclientprotocol/codex-acp``, ``gemini``'s ``@google/gemini-cli``) is prepared exactly as
``kandev runtime update NAME`` prepares it (``npm exec --yes --prefer-online --package=<spec> --
node -e ""``). Daemons under test get it as ``npm_config_cache``: the backend and the control
server both find the cache with ``npm config get cache`` (``daemon.runtimes.launch``), so a
sandboxed launch runs that prepared entry. Prepared once per machine (checked, then reused: a
later run needs no network), under a lock so parallel runs wait for one preparation.
``cache_or_skip(name)`` is what a fixture calls: the cache, or a skip naming why (a failure on CI,
which never skips).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.agents.registry import BUILTIN_AGENTS, BuiltinAgent
from daemon.runtimes.launch import RuntimeNotPrepared, prepared_runtime
from daemon.runtimes.update import stage_argv

CLAUDE = BUILTIN_AGENTS["claude-code"]
PREPARE_TIMEOUT_S = 900


class Unavailable(RuntimeError):
    """npm is missing or the registry cannot be reached: the runtime cannot be prepared."""


def cache_dir(agent: BuiltinAgent) -> Path:
    return Path(f"/var/tmp/kandev-test-npm-{agent.name}-{agent.version}")


def is_prepared(agent: BuiltinAgent = CLAUDE, cache: Path | None = None) -> bool:
    try:
        prepared_runtime(agent, cache or cache_dir(agent))
    except RuntimeNotPrepared:
        return False
    return True


def prepare_cache(name: str = "claude-code") -> Path:
    """The shared npm cache with the pinned runtime of agent ``name`` prepared in it."""
    agent = BUILTIN_AGENTS[name]
    cache = cache_dir(agent)
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise Unavailable("node and npm are needed (packaging/dev/setup.sh installs them)")
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(agent, cache):
            return cache
        work = cache / "work"
        work.mkdir(exist_ok=True)
        (work / "package.json").write_text('{"name": "kandev-test-runtime", "private": true}\n')
        env = {**os.environ, "npm_config_cache": str(cache), "npm_config_update_notifier": "false",
               "npm_config_fund": "false", "npm_config_audit": "false"}
        done = subprocess.run(stage_argv(agent.npm_spec), cwd=work, env=env, capture_output=True, text=True,
                              timeout=PREPARE_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0 or not is_prepared(agent, cache):
            raise Unavailable(f"preparing {agent.npm_spec} failed ({done.returncode}): {done.stderr[-1500:]}")
        return cache


def cache_or_skip(name: str) -> Path:
    """``prepare_cache(name)`` for a fixture: a skip when it cannot be prepared, a failure on CI."""
    try:
        return prepare_cache(name)
    except Unavailable as exc:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"the {name} runtime cannot be prepared: {exc}", pytrace=False)  # CI never skips
        pytest.skip(f"the {name} runtime cannot be prepared: {exc}")
