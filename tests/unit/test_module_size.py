"""Issue 25 (acceptance A): no module in ``daemon/`` or ``ipc/`` is longer than 600 lines and no
class longer than 450, so a reader finds one concern per room.

Sizes are read from the source (``ast``; nothing is imported): a module's lines as ``wc -l``
counts them, a class from its ``class`` line to its last line (docstring and methods included).
A module or class still over its limit is named in ``PENDING`` with the size it has now: it may
shrink, never grow, and an entry it no longer needs fails the test, so the list only gets shorter.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "ipc")
EXCLUDED = ("daemon/store/migrations/",)  # generated alembic revisions: data, not rooms to read
MODULE_MAX = 600
CLASS_MAX = 450

# Still over the limit, each with its size today (it may not grow):
PENDING: dict[str, int] = {}


def _modules() -> Iterator[Path]:
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if not any(path.relative_to(ROOT).as_posix().startswith(prefix) for prefix in EXCLUDED):
                yield path


def sizes(paths: list[Path]) -> dict[str, int]:
    """``path`` -> lines of each module, ``path::Class`` -> lines of each class (nested ones too)."""
    out: dict[str, int] = {}
    for path in paths:
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        out[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                out[f"{name}::{node.name}"] = (node.end_lineno or node.lineno) - node.lineno + 1
    return out


def too_long(measured: dict[str, int], pending: dict[str, int]) -> list[str]:
    problems = []
    for name, size in sorted(measured.items()):
        limit = CLASS_MAX if "::" in name else MODULE_MAX
        allowed = max(limit, pending.get(name, 0))
        if size > allowed:
            kind = "class" if "::" in name else "module"
            problems.append(f"{kind} {name}: {size} lines (at most {allowed})")
    for name in sorted(pending):
        limit = CLASS_MAX if "::" in name else MODULE_MAX
        if measured.get(name, 0) <= limit:
            problems.append(f"{name} is within {limit} lines now: remove it from PENDING")
    return problems


def test_no_module_over_600_lines_and_no_class_over_450() -> None:
    """Issue 25 (acceptance A)."""
    problems = too_long(sizes(list(_modules())), PENDING)
    assert problems == [], "split these by concern (one job per module, its docstring says which):\n" + "\n".join(
        problems)


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    """A planted long module and a long class are found; a pending entry no longer needed is too."""
    planted = tmp_path / "planted.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(CLASS_MAX))
    planted.write_text("class Big:\n" + body + "\n" * (MODULE_MAX - CLASS_MAX))
    measured = sizes([planted])
    assert measured == {"planted.py": MODULE_MAX + 1, "planted.py::Big": CLASS_MAX + 1}
    assert len(too_long(measured, {})) == 2
    assert too_long(measured, {"planted.py": MODULE_MAX + 1, "planted.py::Big": CLASS_MAX + 1}) == []
    assert too_long({"small.py": 10}, {"small.py": 700}) == ["small.py is within 600 lines now: remove it from PENDING"]
