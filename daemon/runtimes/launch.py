"""How a sandboxed agent of a managed npm runtime is started: its prepared entry, read-only.

``npx --yes --prefer-offline <pkg>@<ver>`` cannot run in an agent's sandbox: npm writes into its
cache on every run (the packument, and a ``concurrency.lock`` inside ``_npx/<key>``), and a cache
the agent could write would let one agent rewrite the code every other agent of that runtime runs.
So a sandboxed launch runs the runtime ``kandev runtime update AGENT`` prepared, directly:
``<npm cache>/_npx/<key>/node_modules/.bin/<bin>`` with the runtime's ACP arguments, the tree
``<npm cache>/_npx/<key>`` bound read-only into the sandbox, and its ``node_modules/.bin`` first on
the PATH (as npx would set it). npm itself stays outside. With ``agents.sandbox = "off"`` agents
still start through npx (``BuiltinAgent.argv``).

The cache root is what ``npm config get cache`` prints for the backend (the control server runs
as the same user with the same environment), checked like the repair checks it; the key is
computed (``npx_cache.npx_key``), the bin read from the package's own ``package.json``.
``find_prepared`` asks npm once and keeps the answer: each question costs most of a second of
CPU (npm's own start), and every session start of an npm agent asked twice. A runtime not found
under the kept answer makes it ask again (npm's configuration may have changed since).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from daemon.agents.registry import BuiltinAgent
from daemon.host.agent_user import AgentUserMissing, agent_user
from daemon.runtimes.npx_cache import NPX_DIR, RepairRefused, check_cache_root, npx_key
from ipc.errors import ErrorCode

RUNTIME_NOT_PREPARED = ErrorCode.RUNTIME_NOT_PREPARED
"""The error code of a sandboxed launch of a managed runtime that was never prepared."""
CACHE_TIMEOUT_S = 30.0


class RuntimeNotPrepared(Exception):
    """The runtime's prepared tree is missing or unusable: ``what`` is wrong, and the message adds
    how to fix it by hand (``fix``), for where nothing prepares it on its own."""

    def __init__(self, what: str, fix: str | None = None) -> None:
        super().__init__(f"{what}; {fix}" if fix else what)
        self.what = what


@dataclass(frozen=True)
class PreparedRuntime:
    command: list[str]
    tree: Path  # <cache>/_npx/<key>, bound read-only
    bin_dir: Path  # <tree>/node_modules/.bin, first on the PATH


def npm_cache_root(env: dict[str, str] | None = None) -> Path:
    """``npm config get cache``, checked (blocking). Writes nothing under the cache."""
    try:
        # --logs-max=0: no debug log file under the cache for this question
        done = subprocess.run(["npm", "config", "get", "cache", "--logs-max=0"], capture_output=True, text=True,
                              timeout=CACHE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeNotPrepared(f"cannot ask npm for its cache directory: {exc}") from None
    if done.returncode != 0:
        raise RuntimeNotPrepared(f"npm config get cache failed: {done.stderr.strip()[-300:]}")
    try:
        return check_cache_root(done.stdout)
    except RepairRefused as exc:
        raise RuntimeNotPrepared(f"refusing the npm cache directory: {exc}") from None


def _bin_name(package: str, doc: object) -> str:
    bins = doc.get("bin") if isinstance(doc, dict) else None
    unscoped = package.rsplit("/", 1)[-1]
    if isinstance(bins, str):
        return unscoped
    if isinstance(bins, dict) and bins:
        if len(bins) == 1:
            return str(next(iter(bins)))
        if unscoped in bins:
            return unscoped
    raise RuntimeNotPrepared(f"{package}'s package.json names no single command to run")


def _open_to_others(tree: Path, entry: Path) -> bool:
    """Whether another uid may enter ``tree`` and run ``entry`` (their modes; ACLs aside)."""
    try:
        return (os.stat(tree).st_mode & 0o005 == 0o005) and (os.stat(entry).st_mode & 0o005 == 0o005)
    except OSError:
        return False


def prepared_runtime(agent: BuiltinAgent, cache_root: Path) -> PreparedRuntime:
    """The prepared entry of ``agent`` under ``cache_root`` (blocking; reads its package.json)."""
    tree = cache_root / NPX_DIR / npx_key(agent.npm_spec)
    hint = f"run `kandev runtime update {agent.name}` to prepare it"
    manifest = tree / "node_modules" / agent.package / "package.json"
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise RuntimeNotPrepared(f"the runtime {agent.npm_spec} is not prepared ({manifest} is missing or"
                                 " unreadable)", hint) from None
    if not isinstance(doc, dict) or doc.get("version") != agent.version:
        raise RuntimeNotPrepared(f"{tree} does not hold {agent.npm_spec}", hint)
    bin_dir = tree / "node_modules" / ".bin"
    entry = bin_dir / _bin_name(agent.package, doc)
    real = Path(os.path.realpath(entry))
    if not str(real).startswith(str(Path(os.path.realpath(tree))) + os.sep) or not os.access(real, os.X_OK):
        raise RuntimeNotPrepared(f"{entry} is not an executable inside {tree}", hint)
    try:
        user = agent_user()
    except AgentUserMissing:
        user = None  # the launch itself says so
    if user is not None and user.dedicated and not _open_to_others(tree, real):
        # prepared under a private umask (before kandev 0.3.0 ran agents as their own uid)
        raise RuntimeNotPrepared(f"{tree} is not readable by {user.name}, the user agents run as: remove"
                                 f" it (`rm -rf {tree}`) and {hint}")
    return PreparedRuntime([str(entry), *agent.acp_args], tree, bin_dir)


class _CacheRootMemo:
    """npm's cache directory as npm last answered (one question at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root: Path | None = None

    def get(self, *, ask_again: bool) -> Path:
        with self._lock:
            if ask_again or self._root is None:
                self._root = npm_cache_root()
            return self._root


_CACHE_ROOT = _CacheRootMemo()


def find_prepared(agent: BuiltinAgent) -> PreparedRuntime:
    """``prepared_runtime`` under npm's cache directory (blocking): the directory npm named
    before, or, when the runtime is not there, the one it names now."""
    root = _CACHE_ROOT.get(ask_again=False)
    try:
        return prepared_runtime(agent, root)
    except RuntimeNotPrepared:
        now = _CACHE_ROOT.get(ask_again=True)
        if now == root:
            raise
    return prepared_runtime(agent, now)
