"""daemon.runtimes.launch.find_prepared: npm is asked for its cache directory once, not at every
session start (each question costs most of a second of CPU), and asked again when the runtime is
not where npm said before (its configuration changed meanwhile).

A stand-in ``npm`` on the PATH prints the directory named in a file and counts its calls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.agents.registry import get_agent
from daemon.runtimes import launch
from daemon.runtimes.npx_cache import NPX_DIR, npx_key

AGENT = get_agent("codex")


def _prepare(root: Path) -> Path:
    """A prepared tree of AGENT under the cache root ``root`` (its entry world-executable)."""
    tree = root / NPX_DIR / npx_key(AGENT.npm_spec)
    pkg = tree / "node_modules" / AGENT.package
    pkg.mkdir(parents=True)
    (pkg / "package.json").write_text(json.dumps({"version": AGENT.version, "bin": {"codex-acp": "bin.js"}}))
    (pkg / "bin.js").write_text("")
    (pkg / "bin.js").chmod(0o755)
    bin_dir = tree / "node_modules" / ".bin"
    bin_dir.mkdir()
    (bin_dir / "codex-acp").symlink_to(pkg / "bin.js")
    for d in (root, root / NPX_DIR, tree, tree / "node_modules", pkg, bin_dir):
        d.chmod(0o755)
    return tree


@pytest.fixture
def npm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(the file naming the cache directory npm reports, the file counting npm's calls)."""
    bin_dir, answer, calls = tmp_path / "bin", tmp_path / "answer", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(f'#!/bin/sh\necho x >> "{calls}"\ncat "{answer}"\n')
    (bin_dir / "npm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(launch, "_CACHE_ROOT", launch._CacheRootMemo())
    return answer, calls


def _calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def test_npm_is_asked_once_for_many_launches(npm: tuple[Path, Path], tmp_path: Path) -> None:
    answer, calls = npm
    tree = _prepare(tmp_path / "cache" / "npm")
    answer.write_text(str(tmp_path / "cache" / "npm"))
    for _ in range(3):
        assert launch.find_prepared(AGENT).tree == tree
    assert _calls(calls) == 1


def test_a_runtime_not_under_the_kept_answer_makes_npm_asked_again(npm: tuple[Path, Path], tmp_path: Path) -> None:
    answer, calls = npm
    _prepare(tmp_path / "old" / "npm")
    answer.write_text(str(tmp_path / "old" / "npm"))
    launch.find_prepared(AGENT)
    new_tree = _prepare(tmp_path / "new" / "npm")
    answer.write_text(str(tmp_path / "new" / "npm"))  # npm's cache moved; the old tree is gone
    (tmp_path / "old").rename(tmp_path / "gone")
    assert launch.find_prepared(AGENT).tree == new_tree
    assert _calls(calls) == 2


def test_not_prepared_anywhere_is_refused_after_asking_again(npm: tuple[Path, Path], tmp_path: Path) -> None:
    answer, calls = npm
    answer.write_text(str(tmp_path / "empty" / "npm"))
    with pytest.raises(launch.RuntimeNotPrepared, match="kandev runtime update codex"):
        launch.find_prepared(AGENT)
    assert _calls(calls) == 2  # the kept answer, then asked again: the same, so refused
