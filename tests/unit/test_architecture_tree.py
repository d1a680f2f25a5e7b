"""Issue 43 scenario C: docs/architecture.md opens with the tree, and the tree matches the real one.

The tree is the fenced block under ``## The tree``: one line per package folder (``daemon/x/``) or
entry-point module at the top of ``daemon/`` (``daemon/x.py``), then what it owns. Every package of
``daemon/`` and ``ipc/`` is listed once, nothing else is, and each line says what it owns.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.layering import DAEMON_ENTRY_POINTS, EXCLUDED, LAYERS, TOPS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def documented_tree(text: str) -> list[tuple[str, str]]:
    """(path, what it owns) for each line of the fenced block under ``## The tree``."""
    section = text.split("## The tree", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "no fenced block under '## The tree'"
    out = []
    for line in block.group(1).splitlines():
        path, _, what = line.partition(" ")
        out.append((path, what.strip()))
    return out


def real_tree() -> set[str]:
    packages = {
        init.parent.relative_to(ROOT).as_posix() + "/"
        for top in ("daemon", "ipc")
        for init in (ROOT / top).rglob("__init__.py")
        if not any(init.relative_to(ROOT).as_posix().startswith(prefix) for prefix in EXCLUDED)
    }
    packages.discard("daemon/")  # the root itself: its lines are the packages below it
    entry_points = {f"daemon/{name}" for name in DAEMON_ENTRY_POINTS if name != "__init__.py"}
    return packages | entry_points


def test_the_documented_tree_is_the_real_one() -> None:
    text = DOC.read_text()
    assert text.index("## The tree") < text.index("## Read this first") < text.index("## Processes"), \
        "docs/architecture.md opens with the tree, then the reading order"
    lines = documented_tree(text)
    paths = [path for path, _ in lines]
    assert len(paths) == len(set(paths)), "a path is listed twice"
    assert set(paths) == real_tree(), (sorted(set(paths) - real_tree()), sorted(real_tree() - set(paths)))
    assert all(what for _, what in lines), "every line says what its package owns"


def test_the_tree_lists_the_layers_bottom_up() -> None:
    """The tree's order is the layering's: no package is listed after one of a higher layer (the
    control server's and the backend's own folders hold modules of several layers, their tops)."""
    modules = [path.removesuffix("/").removesuffix(".py").replace("/", ".")
               for path, _ in documented_tree(DOC.read_text())]
    layers = [LAYERS[m] for m in modules if m not in TOPS]
    assert layers == sorted(layers), list(zip(modules, layers, strict=False))
