"""The real Claude Code runtime for the tests (Issue 12): prepared once, shared by every test.

``prepare_cache()`` gives an npm cache directory under /var/tmp, named after the pinned spec, in
which ``@zed-industries/claude-code-acp`` (the built-in ``claude-code`` agent's pinned version) is
prepared exactly as ``kandev runtime update claude-code`` prepares it (``npm exec --yes
--prefer-online --package=<spec> -- node -e ""``). Daemons under test get it as
``npm_config_cache``: the backend and the control server both find the cache with ``npm config get
cache`` (``daemon.runtimes.launch``), so a sandboxed launch runs that prepared entry. Prepared once
per machine (checked, then reused: a later run needs no network), under a lock so parallel runs
wait for one preparation.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from daemon.agents.registry import BUILTIN_AGENTS
from daemon.runtimes.launch import RuntimeNotPrepared, prepared_runtime
from daemon.runtimes.update import stage_argv

CLAUDE = BUILTIN_AGENTS["claude-code"]
CACHE = Path(f"/var/tmp/kandev-test-npm-{CLAUDE.name}-{CLAUDE.version}")
PREPARE_TIMEOUT_S = 600


class Unavailable(RuntimeError):
    """npm is missing or the registry cannot be reached: the runtime cannot be prepared."""


def is_prepared(cache: Path = CACHE) -> bool:
    try:
        prepared_runtime(CLAUDE, cache)
    except RuntimeNotPrepared:
        return False
    return True


def prepare_cache(cache: Path = CACHE) -> Path:
    """The shared npm cache with the pinned claude-code runtime prepared in it."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        raise Unavailable("node and npm are needed (packaging/dev/setup.sh installs them)")
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(cache.parent / f".{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(cache):
            return cache
        work = cache / "work"
        work.mkdir(exist_ok=True)
        (work / "package.json").write_text('{"name": "kandev-test-runtime", "private": true}\n')
        env = {**os.environ, "npm_config_cache": str(cache), "npm_config_update_notifier": "false",
               "npm_config_fund": "false", "npm_config_audit": "false"}
        done = subprocess.run(stage_argv(CLAUDE.npm_spec), cwd=work, env=env, capture_output=True, text=True,
                              timeout=PREPARE_TIMEOUT_S, stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0 or not is_prepared(cache):
            raise Unavailable(f"preparing {CLAUDE.npm_spec} failed ({done.returncode}): {done.stderr[-1500:]}")
        return cache
