"""The test suite's own layout rules (Issue 13 scenario B/build item 5).

Shared test machinery lives in ``tests/support``; test modules and conftests use it and nothing of
each other. Every ``tests/**/*.py`` is parsed with ``ast`` and checked for:

- an import of a test module (a module named ``test_*``) or of a conftest, in any spelling
  (``from tests.integration.test_x import ...``, ``from tests.integration import test_x``,
  ``import tests.integration.conftest``, relative imports);
- an import of a private name (``_x``) from any module of ``tests``;
- a module-level ``run``, ``wait_until`` or ``wait_for`` (or their ``_``-prefixed forms) anywhere
  but the one definition in ``tests/support`` (``aio.run``, ``waiting.wait_until``);
- a conftest defining a module-level function that is neither a fixture nor a ``pytest_*`` hook.

The checker itself is tested on sources with known violations, so it cannot pass vacuously.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

# The one home of each shared helper: its module (dotted name) for each name.
CANONICAL = {"run": "tests.support.aio", "wait_until": "tests.support.waiting"}
HELPER_NAMES = {"run", "wait_until", "wait_for"}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def module_name(path: Path) -> str:
    """``tests/integration/test_x.py`` -> ``tests.integration.test_x`` (``__init__`` -> the package)."""
    parts = list(path.relative_to(TESTS.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_test_module(dotted: str) -> bool:
    last = dotted.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute dotted name an ``ImportFrom`` in ``module`` (a module, not a package) refers to."""
    if not node.level:
        return node.module or ""
    package = module.split(".")[: -node.level]
    return ".".join(package + ([node.module] if node.module else []))


def is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
        if isinstance(target, ast.Name) and target.id == "fixture":
            return True
    return False


def check_source(source: str, module: str, shown: str) -> list[Violation]:
    """Every layout violation of one module's source (``module``: its dotted name)."""
    tree = ast.parse(source, filename=shown)
    out: list[Violation] = []
    is_package = shown.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tests.") and is_test_module(alias.name):
                    out.append(Violation(shown, node.lineno, f"imports test module {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve(module + (".__init__" if is_package else ""), node)
            if not (source_module == "tests" or source_module.startswith("tests.")):
                continue
            if is_test_module(source_module):
                out.append(Violation(shown, node.lineno, f"imports from test module {source_module}"))
                continue
            for alias in node.names:
                if is_test_module(alias.name):
                    out.append(Violation(shown, node.lineno, f"imports test module {source_module}.{alias.name}"))
                elif alias.name.startswith("_"):
                    out.append(Violation(shown, node.lineno, f"imports private name {alias.name} of {source_module}"))
    for node in tree.body:
        names: list[tuple[str, int]] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append((node.name, node.lineno))
        elif isinstance(node, ast.Assign):
            names += [(t.id, node.lineno) for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append((node.target.id, node.lineno))
        for name, line in names:
            if name.lstrip("_") in HELPER_NAMES and CANONICAL.get(name) != module:
                home = CANONICAL.get(name.lstrip("_"), "tests.support.waiting")
                out.append(Violation(shown, line, f"defines its own {name} (use {home})"))
        if not module.endswith(".conftest"):
            continue
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not (
            is_fixture(node) or node.name.startswith("pytest_")
        ):
            out.append(Violation(shown, node.lineno, f"conftest defines helper {node.name} (move it to tests/support)"))
        elif isinstance(node, ast.ClassDef):
            out.append(Violation(shown, node.lineno, f"conftest defines class {node.name} (move it to tests/support)"))
    return out


def test_no_test_module_imports_another_and_helpers_live_in_support() -> None:
    """Issue 13 scenario B/build item 5: the whole tests tree obeys the layout rules."""
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50 and TESTS / "support" / "aio.py" in files, files[:5]
    violations = [
        v for path in files
        for v in check_source(path.read_text(), module_name(path), str(path.relative_to(TESTS.parent)))
    ]
    assert not violations, "test layout rules broken:\n" + "\n".join(map(str, violations))


def test_the_one_run_and_wait_until_exist_where_the_rules_say() -> None:
    from tests.support import aio, waiting

    assert aio.run.__module__ == CANONICAL["run"] and waiting.wait_until.__module__ == CANONICAL["wait_until"]


BAD = '''
import tests.integration.test_resume
import tests.integration.conftest as c
from tests.integration.test_agentctl_server import STEP
from tests.integration import test_resume, conftest
from tests.support.agentctl import _hidden
from .test_sibling import thing
from . import conftest as here
import asyncio


def run(coro):
    return asyncio.run(coro)


async def _wait_for(predicate):
    pass


wait_until = None


def fine():
    def run():  # nested: allowed
        pass
'''


def test_checker_reports_each_kind_of_violation() -> None:
    got = check_source(BAD, "tests.integration.test_bad", "tests/integration/test_bad.py")
    assert [(v.line, v.what) for v in got] == [
        (2, "imports test module tests.integration.test_resume"),
        (3, "imports test module tests.integration.conftest"),
        (4, "imports from test module tests.integration.test_agentctl_server"),
        (5, "imports test module tests.integration.test_resume"),
        (5, "imports test module tests.integration.conftest"),
        (6, "imports private name _hidden of tests.support.agentctl"),
        (7, "imports from test module tests.integration.test_sibling"),
        (8, "imports test module tests.integration.conftest"),
        (12, "defines its own run (use tests.support.aio)"),
        (16, "defines its own _wait_for (use tests.support.waiting)"),
        (20, "defines its own wait_until (use tests.support.waiting)"),
    ]


def test_checker_holds_conftests_to_fixtures_and_hooks() -> None:
    source = '''
import pytest


@pytest.fixture
def home(tmp_path):
    return tmp_path


def pytest_collection_modifyitems(config, items):
    pass


def helper():
    pass


class Driver:
    pass
'''
    got = check_source(source, "tests.integration.conftest", "tests/integration/conftest.py")
    assert [(v.line, v.what) for v in got] == [
        (14, "conftest defines helper helper (move it to tests/support)"),
        (18, "conftest defines class Driver (move it to tests/support)"),
    ]


def test_the_canonical_definitions_are_allowed_only_at_home() -> None:
    source = "def run(coro, timeout=1.0):\n    pass\n"
    assert check_source(source, "tests.support.aio", "tests/support/aio.py") == []
    assert [v.what for v in check_source(source, "tests.support.other", "tests/support/other.py")] == [
        "defines its own run (use tests.support.aio)"
    ]
