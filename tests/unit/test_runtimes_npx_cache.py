"""The npx cache key and the path safety of the one repair kandev makes (RESUME-12, NPM-CTX-5).

The key derivation is checked three ways: against a value read off a real
``_npx`` directory npm 11.19.1 created for the spec, against node's own crypto
running libnpmexec's formula, and (when npm is installed) against the formula in
the installed libnpmexec source. tests/integration/test_runtimes_npm.py checks
it once more against the directory the real ``npx`` makes in a private cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from daemon.agents.registry import BUILTIN_AGENTS, EXACT_VERSION_RE, npm_agent
from daemon.runtimes.npx_cache import (
    RepairRefused,
    _remove_key,
    check_cache_root,
    entry_path,
    npx_key,
    remove_npx_entry,
    trusted_spec,
)

CLAUDE = BUILTIN_AGENTS["claude-code"]
SPEC = "@zed-industries/claude-code-acp@0.16.2"
# Read off <cache>/_npx/ after `npx --yes @zed-industries/claude-code-acp@0.16.2` with npm 11.19.1.
REAL_NPM_KEY = "8e2f889e245897c3"

# libnpmexec lib/index.js, reproduced in node: sorted spec list, '\n'-joined, sha512, 16 hex digits.
NODE_KEY_JS = (
    "const c = require('crypto');"
    "const specs = process.argv.slice(1);"
    "process.stdout.write(c.createHash('sha512')"
    ".update(specs.sort((a, b) => a.localeCompare(b, 'en')).join('\\n')).digest('hex').slice(0, 16))"
)


def test_key_is_first_16_hex_of_sha512_of_the_exact_spec() -> None:
    """NPM-CTX-2, NPM-CTX-5: the key is computed for the exact spec, as npm computes it."""
    assert CLAUDE.npm_spec == SPEC
    assert npx_key(SPEC) == hashlib.sha512(SPEC.encode()).hexdigest()[:16] == REAL_NPM_KEY
    keys = {npx_key(a.npm_spec) for a in BUILTIN_AGENTS.values() if a.runtime == "npm"}
    assert len(keys) == 4 and all(len(k) == 16 and int(k, 16) >= 0 for k in keys)
    assert npx_key("@zed-industries/claude-code-acp@0.16.1") != REAL_NPM_KEY  # version-specific tree
    with pytest.raises(ValueError):
        npx_key("a@1.0.0\nb@1.0.0")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_key_matches_libnpmexec_formula_run_by_node() -> None:
    for agent in BUILTIN_AGENTS.values():
        if agent.runtime != "npm":
            continue
        out = subprocess.run(["node", "-e", NODE_KEY_JS, agent.npm_spec], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        assert out == npx_key(agent.npm_spec)


def test_installed_libnpmexec_uses_that_formula() -> None:
    """Fails loudly if a future npm changes how _npx keys are made (then npx_key must follow)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    # Found from the npm executable (bin/npm-cli.js), without running npm: running it
    # would write a debug log into the machine's npm cache.
    npm_dir = Path(os.path.realpath(npm)).parent.parent
    source = npm_dir / "node_modules" / "libnpmexec" / "lib" / "index.js"
    if not source.exists():
        pytest.skip(f"no libnpmexec source at {source}")
    text = source.read_text()
    start = text.index("crypto.createHash('sha512')")
    block = "".join(text[start:start + 700].split())
    assert ".sort((a,b)=>a.localeCompare(b,'en')).join('\\n'))" in block
    assert ".digest('hex').slice(0,16)" in block
    assert "resolve(npxCache,hash)" in block


def test_pinned_versions_are_exact_and_names_plain() -> None:
    """NPM-CTX-1, NPM-CTX-2: exact package@version for every managed agent; ACP args are built-in metadata."""
    npm = {a.name: a for a in BUILTIN_AGENTS.values() if a.runtime == "npm"}
    assert set(npm) == {"claude-code", "codex", "gemini", "opencode"}
    assert npm["claude-code"].package == "@zed-industries/claude-code-acp"
    assert npm["gemini"].acp_args == ("--acp",)
    assert npm["opencode"].acp_args == ("acp",)
    for agent in npm.values():
        assert EXACT_VERSION_RE.match(agent.version)
        assert agent.argv() == ["npx", "--yes", "--prefer-offline", agent.npm_spec, *agent.acp_args]
    for bad in ("latest", "^1.0.0", "1.0", "1.0.0-beta.1", "1.0.0 || 2", "01.0.0", "1.0.0; rm -rf /"):
        with pytest.raises(ValueError):
            npm_agent("x", "pkg", bad)
    for bad in ("../pkg", "/etc/passwd", "@scope/../x", "https://evil/pkg.tgz", "pkg name", "git+ssh://x"):
        with pytest.raises(ValueError):
            npm_agent("x", bad, "1.0.0")


# ----------------------------------------------------------------- the repair


def _cache(tmp_path: Path) -> tuple[Path, Path]:
    """A fake npm cache with the claude entry, a neighbour entry and a content cache."""
    root = tmp_path / "npm-cache"
    entry = root / "_npx" / REAL_NPM_KEY
    (entry / "node_modules" / "x").mkdir(parents=True)
    (entry / "package.json").write_text("{")
    (root / "_npx" / "0123456789abcdef" / "node_modules").mkdir(parents=True)
    (root / "_cacache" / "index-v5").mkdir(parents=True)
    (root / "_cacache" / "index-v5" / "f").write_text("cached")
    return root, entry


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_removes_only_the_spec_entry(tmp_path: Path) -> None:
    """RESUME-12: deletes nothing except _npx/<key> of the selected built-in package."""
    root, entry = _cache(tmp_path)
    before = _listing(root)
    result = remove_npx_entry(root, CLAUDE.package, CLAUDE.version)
    assert result.removed and result.path == str(entry) == str(entry_path(root, SPEC))
    assert not entry.exists()
    rel = f"_npx/{REAL_NPM_KEY}"
    assert _listing(root) == {p for p in before if p != rel and not p.startswith(rel + "/")}
    again = remove_npx_entry(root, CLAUDE.package, CLAUDE.version)  # nothing left: nothing to do
    assert not again.removed


def test_absent_cache_or_npx_dir_removes_nothing(tmp_path: Path) -> None:
    assert not remove_npx_entry(tmp_path / "none" / "cache", CLAUDE.package, CLAUDE.version).removed
    (tmp_path / "c" / "cache").mkdir(parents=True)
    assert not remove_npx_entry(tmp_path / "c" / "cache", CLAUDE.package, CLAUDE.version).removed


@pytest.mark.parametrize(
    "package,version",
    [
        ("left-pad", "1.3.0"),  # a real package, but not built-in
        ("../../etc", "1.0.0"),
        ("/etc/passwd", "1.0.0"),
        ("@zed-industries/../../x", "0.16.2"),
        (CLAUDE.package, "latest"),
        (CLAUDE.package, "^0.16.2"),
        (CLAUDE.package, "0.16.2-beta.1"),
        (CLAUDE.package, "../0.16.2"),
        (CLAUDE.package, "0.16.2 && rm -rf /"),
    ],
)
def test_unknown_packages_and_loose_versions_are_refused(tmp_path: Path, package: str, version: str) -> None:
    """RESUME-12 / NPM-CTX-1: package names come only from built-in metadata, versions are exact."""
    root, _ = _cache(tmp_path)
    before = _listing(root)
    with pytest.raises(RepairRefused):
        remove_npx_entry(root, package, version)
    with pytest.raises(RepairRefused):
        trusted_spec(package, version)
    assert _listing(root) == before


@pytest.mark.parametrize("text", ["", "relative/cache", "/", "/tmp", "/var/../root/.npm", "/a/b\n/c/d"])
def test_broad_relative_and_dotdot_cache_roots_are_refused(text: str) -> None:
    """NPM-CTX-5: broad roots, '..' and anything that is not one absolute path."""
    with pytest.raises(RepairRefused):
        check_cache_root(text)


def test_cache_root_symlink_is_refused(tmp_path: Path) -> None:
    root, entry = _cache(tmp_path)
    link = tmp_path / "link-cache"
    link.symlink_to(root)
    with pytest.raises(RepairRefused, match="symlink"):
        remove_npx_entry(link, CLAUDE.package, CLAUDE.version)
    assert entry.exists()


def test_npx_dir_symlink_pointing_outside_is_refused(tmp_path: Path) -> None:
    """Nothing outside <cache>/_npx: an _npx that is a symlink elsewhere is never followed."""
    root = tmp_path / "cache"
    root.mkdir()
    outside = tmp_path / "outside"
    (outside / REAL_NPM_KEY).mkdir(parents=True)
    (outside / REAL_NPM_KEY / "precious").write_text("keep")
    (root / "_npx").symlink_to(outside)
    with pytest.raises(RepairRefused, match="symlink"):
        remove_npx_entry(root, CLAUDE.package, CLAUDE.version)
    assert (outside / REAL_NPM_KEY / "precious").read_text() == "keep"


def test_entry_symlink_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "_npx").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / "_npx" / REAL_NPM_KEY).symlink_to(outside)
    with pytest.raises(RepairRefused, match="symlink"):
        remove_npx_entry(root, CLAUDE.package, CLAUDE.version)
    assert (root / "_npx" / REAL_NPM_KEY).is_symlink() and (outside / "precious").exists()


def test_entry_that_is_a_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    (root / "_npx").mkdir(parents=True)
    (root / "_npx" / REAL_NPM_KEY).write_text("not a tree")
    with pytest.raises(RepairRefused, match="not a directory"):
        remove_npx_entry(root, CLAUDE.package, CLAUDE.version)


def test_symlinks_inside_the_entry_are_removed_not_followed(tmp_path: Path) -> None:
    root, entry = _cache(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (entry / "node_modules" / "evil").symlink_to(outside)
    assert remove_npx_entry(root, CLAUDE.package, CLAUDE.version).removed
    assert not entry.exists() and (outside / "precious").read_text() == "keep"


@pytest.mark.parametrize("key", ["../outside", "0123456789abcdef/..", "..", "", "/etc", "0123456789ABCDEF"])
def test_only_npx_keys_name_an_entry(tmp_path: Path, key: str) -> None:
    """Anything that is not a 16-hex-digit key (a path, '..') is refused before any lookup."""
    root, _ = _cache(tmp_path)
    (tmp_path / "outside").mkdir()
    before = _listing(tmp_path)
    with pytest.raises(RepairRefused):
        _remove_key(root, key)
    assert _listing(tmp_path) == before


def test_no_caller_supplied_path_reaches_the_backend() -> None:
    """RESUME-12: the update op takes an agent name only; a path argument is never read."""
    from daemon.api import ops as api

    op = api.TABLE.get("runtime_update")
    assert dict(op.required) == {"agent": str} and not op.optional
    assert op.validate({"agent": "claude-code", "path": "/etc", "cache": "/"}) == {"agent": "claude-code"}


def test_cache_root_is_normalized(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    assert check_cache_root(f"{root}/\n") == root
    assert check_cache_root(f"{root}//") == root
    assert os.path.isabs(check_cache_root(str(root)))
