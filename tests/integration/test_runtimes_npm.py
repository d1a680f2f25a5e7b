"""Issue 5 scenario E: a real managed runtime repaired through the real npm (RESUME-11, RESUME-12, RESUME-13).

The real ``@zed-industries/claude-code-acp`` is installed through ``npx`` into a
PRIVATE npm cache (``npm_config_cache`` points into the test's directory, for the
test's own npm runs and for the backend, so the machine's cache is never used). A
file in its ``_npx/<key>`` tree is truncated; ``kandev runtime update claude-code``
against a real backend must then remove exactly that tree, retry once, report the
ACP protocol version from the probe, and leave everything else under the cache as it
was: nothing outside ``_npx/<key>`` removed, nothing rewritten but npm's own
bookkeeping. npm itself, when it revalidates online, adds ``_logs`` files and cache
content and refreshes entries of its ``_cacache/index-v5`` buckets; the test checks
that every index entry present before is still present, and that the content store
and everything else (a neighbour ``_npx`` tree, a sentinel file) is byte-identical.

Two variants: the truncated ``package.json`` of the tree makes the first *staging*
fail (npm: EJSONPARSE); the truncated entry script passes staging (npm considers
the tree installed) and makes the first *probe* fail.

Needs node, npm and the npm registry (the neighbour tree is installed from it, and the repair
revalidates online); the agent's own tree is copied from the machine's prepared claude-code cache. Marked ``npm`` (deselect with ``-m 'not npm'``); bounded at 180 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import acp
import psutil
import pytest

from daemon.agents.registry import BUILTIN_AGENTS
from daemon.runtimes.npx_cache import npx_key

pytestmark = [pytest.mark.npm, pytest.mark.timeout(180)]

AGENT = BUILTIN_AGENTS["claude-code"]
SPEC = AGENT.npm_spec
KEY = npx_key(SPEC)
MARKER = "kandev-test-marker"


def _npm_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith("npm_config_")}
    env["npm_config_cache"] = str(cache)
    env["npm_config_update_notifier"] = "false"
    # npm keeps 10 debug logs by default and deletes older ones; keep them all so that
    # "nothing outside _npx/<key> was removed" holds for npm's own files too.
    env["npm_config_logs_max"] = "1000"
    return env


@pytest.fixture
def npm_cache(short_tmp: Path, claude_npm_cache: Path) -> dict[str, Any]:
    """A private npm cache holding the agent as npx installed it, plus a neighbour npx tree. The
    agent's tree and npm's content store are copied from the machine's prepared claude-code cache
    (tests/support/npm_runtimes.py: installed once per machine by ``npm exec``, as npx does); the
    neighbour is installed here by the real npx from the registry."""
    for tool in ("node", "npm", "npx"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install nodejs npm)")
    cache = short_tmp / "npm-cache"
    work = short_tmp / "npm-work"
    work.mkdir()
    env = _npm_env(cache)
    shutil.copytree(claude_npm_cache / "_cacache", cache / "_cacache", symlinks=True)
    shutil.copytree(claude_npm_cache / "_npx" / KEY, cache / "_npx" / KEY, symlinks=True)
    got = subprocess.run(["npm", "config", "get", "cache"], env=env, cwd=work, capture_output=True, text=True,
                         timeout=30)
    assert got.stdout.strip() == str(cache)  # the private cache really is the one npm uses
    t0 = time.monotonic()
    proc = subprocess.run(["npx", "--yes", "semver@7.6.3", "1.2.3"], env=env, cwd=work, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "1.2.3", proc.stderr[-2000:]
    install_s = time.monotonic() - t0
    entries = sorted(p.name for p in (cache / "_npx").iterdir())
    assert KEY in entries and npx_key("semver@7.6.3") in entries and len(entries) == 2
    # The derivation, verified against what npx itself made:
    manifest = json.loads((cache / "_npx" / KEY / "package.json").read_text())
    assert manifest["_npx"]["packages"] == [SPEC]
    (cache / "kandev-sentinel.txt").write_text("not npm's; must survive\n")
    return {"cache": cache, "env": env, "install_s": install_s}


def _snapshot(cache: Path) -> dict[str, tuple[str, Any]]:
    """Everything under the cache outside _npx/<key>: kind and content (bytes for files)."""
    skip = cache / "_npx" / KEY
    out: dict[str, tuple[str, Any]] = {}
    for dirpath, dirnames, filenames in os.walk(cache):
        here = Path(dirpath)
        if here == skip or skip in here.parents:
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            if p == skip:
                continue
            rel = str(p.relative_to(cache))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", None)
            else:
                out[rel] = ("file", p.read_bytes())
    return out


def _compare(before: dict[str, tuple[str, Any]], after: dict[str, tuple[str, Any]]) -> None:
    removed = sorted(set(before) - set(after))
    assert not removed, f"removed outside _npx/{KEY}: {removed[:10]}"
    for rel, (kind, data) in before.items():
        now_kind, now = after[rel]
        assert now_kind == kind, rel
        if now == data:
            continue
        # Only npm's own index buckets may change (npm refreshes an entry when it revalidates
        # online), and every entry they held is still there; the content store never changes.
        assert rel.startswith("_cacache/index-v5/") and kind == "file", f"{rel} was rewritten"
        assert _index_keys(data) <= _index_keys(now), f"{rel} lost entries"
    added = sorted(set(after) - set(before))
    assert all(rel.startswith(("_logs", "_cacache")) for rel in added), added


def _index_keys(bucket: bytes) -> set[str]:
    """The keys of a cacache index bucket (lines of ``<sha1>\\t<json entry>``)."""
    keys = set()
    for line in bucket.decode().splitlines():
        if "\t" in line:
            keys.add(json.loads(line.split("\t", 1)[1])["key"])
    return keys


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("broken", ["package.json", "entry script"])
def test_runtime_update_repairs_only_its_own_npx_tree(kandev_factory: Any, npm_cache: dict[str, Any],
                                                      broken: str) -> None:
    """E (RESUME-11, RESUME-12, RESUME-13): only _npx/<key> removed and rebuilt, one retry, the probe's protocol version."""
    cache: Path = npm_cache["cache"]
    entry = cache / "_npx" / KEY
    pkg_dir = entry / "node_modules" / Path(AGENT.package)
    bin_rel = json.loads((pkg_dir / "package.json").read_text())["bin"]["claude-code-acp"]
    script = (pkg_dir / bin_rel).resolve()
    good = {"package.json": _digest(entry / "package.json"), "entry script": _digest(script)}
    target = entry / "package.json" if broken == "package.json" else script
    os.truncate(target, 0 if broken == "package.json" else target.stat().st_size // 3)
    (entry / MARKER).write_text("gone once the tree is removed")
    before = _snapshot(cache)

    npm_env = {k: v for k, v in npm_cache["env"].items() if k.startswith("npm_config_")}
    k = kandev_factory("rt", **npm_env)
    k.up()
    t0 = time.monotonic()
    proc = k.run("runtime", "update", "claude-code", timeout=170)
    update_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    print(f"\n[{broken}] npx install {npm_cache['install_s']:.1f} s, kandev runtime update {update_s:.1f} s")
    print(proc.stderr)

    # The final object of --json, and the retry after exactly one repair.
    assert {"attempts", "repaired", "probe", "state", "detail"} <= set(result)
    assert result["state"] == "succeeded" and result["attempts"] == 2 and result["repaired"] is True
    assert result["repair"] == {"path": str(entry), "removed": True}
    assert result["probe"]["ok"] is True
    assert result["probe"]["protocol_version"] == acp.PROTOCOL_VERSION == 1
    assert result["probe"]["agent_version"] == AGENT.version
    # Progress was shown on stderr, step by step.
    lines = proc.stderr.splitlines()
    first_failure = "staging" if broken == "package.json" else "probe"
    assert any("attempt 1 failed" in line and (("EJSONPARSE" in line) if first_failure == "staging"
                                                else ("ACP probe failed" in line)) for line in lines), lines
    assert any(f"removed {entry}" in line for line in lines)
    assert any("attempt 2/2: ACP initialize probe" in line for line in lines)
    assert "[succeeded]" in lines[-1]

    # _npx/<key> was removed (the marker is gone) and rebuilt (the broken file is whole again).
    assert not (entry / MARKER).exists()
    assert _digest(entry / "package.json") == good["package.json"]
    assert _digest(script) == good["entry script"]
    # Nothing else under the cache was removed or rewritten.
    _compare(before, _snapshot(cache))
    assert (cache / "kandev-sentinel.txt").read_text() == "not npm's; must survive\n"

    # The job is recorded; asking again starts a new job that succeeds at once, deleting nothing.
    (entry / MARKER).write_text("stays: no failure, no repair")
    again = json.loads(k.run("runtime", "update", "claude-code", timeout=170).stdout)
    assert again["state"] == "succeeded" and again["attempts"] == 1 and again["repaired"] is False
    assert again["job_id"] != result["job_id"] and (entry / MARKER).exists()


def test_issue_10_a_managed_runtime_runs_in_its_sandbox_from_its_prepared_tree(
        kandev_factory: Any, npm_cache: dict[str, Any]) -> None:
    """Issue 10 (a sandbox for every agent, managed npm runtimes included): the real claude-code
    runtime prepared in the cache starts in its sandbox straight from ``_npx/<key>`` (npx would
    write into the cache; the tree is bound read-only), answers the ACP handshake there, and the
    launch writes nothing under the cache. (A runtime never prepared is prepared by its first use,
    Issue 12 item 3: tests/integration/test_runtime_first_use.py.)"""
    cache: Path = npm_cache["cache"]
    tree = cache / "_npx" / KEY
    npm_env = {k: v for k, v in npm_cache["env"].items() if k.startswith("npm_config_")}
    k = kandev_factory("sandboxed", **npm_env)
    k.up()
    before = {p: os.lstat(p).st_mtime_ns for p in cache.rglob("*")}
    task = k.cli("task", "create", "--title", "npm")["task_id"]
    sid = k.cli("session", "start", task, "--agent", "claude-code")["session_id"]
    show = k.show(sid)
    assert show["state"] == "WAITING_FOR_INPUT" and show["agent_pid"], show
    argv = psutil.Process(show["agent_pid"]).cmdline()
    assert argv[0].endswith("bwrap") and ["--ro-bind", str(tree), str(tree)] == argv[argv.index(str(tree)) - 1:
                                                                                    argv.index(str(tree)) + 2]
    assert argv[-1] == str(tree / "node_modules" / ".bin" / "claude-code-acp")
    assert k.status()["sandbox"]["sandboxed"] is True
    k.cli("down")
    after = {p: os.lstat(p).st_mtime_ns for p in cache.rglob("*")}
    assert after == before  # npm never ran: nothing under the cache was added, removed or touched
