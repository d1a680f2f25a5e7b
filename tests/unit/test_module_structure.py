"""Issue 13 scenario B, Issue 43 scenario A and Issue 43 scenario B: the product modules form no import cycle,
never reach into each other's private names, import only their own or lower layers, and no folder
is a flat list.

Every module under ``daemon/`` and ``ipc/`` is parsed with ``ast`` (nothing is imported), so
the check covers code paths no test runs. The rules:

- the graph of module-level and function-level imports between product modules has no cycle
  (``if TYPE_CHECKING:`` imports count too: a cycle for the type checker is a cycle for the
  reader);
- no module imports an underscore name from another module (``from X import _y``), and no
  module uses an underscore attribute of another product module or of an object it got from
  elsewhere (``other._y``; dunder names such as ``__name__`` are public). Inside a module,
  ``self._y`` / ``cls._y`` and its own module-level ``_y`` are the module's own business;
- every module belongs to one layer of ``LAYERS`` (the longest entry that names it or a package
  holding it) and imports only modules of its own layer entry or of lower layers;
- no folder holds more than 15 modules, and ``daemon/`` itself holds only its entry points.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

from tests.support.layering import (
    DAEMON_ENTRY_POINTS,
    EXCLUDED,
    LAYERS,
    MAX_MODULES_PER_FOLDER,
    TOPS,
    layer_of,
    upward_imports,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "ipc")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(prefix) for prefix in EXCLUDED):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, path).split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _product(name: str) -> str | None:
    """The product module ``name`` refers to (itself, or the nearest enclosing package)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> Iterator[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of ``module``."""
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, None, node.lineno
                else:
                    yield target, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _name, _line in _imports(module, path):
            dep = _product(target)
            if dep is not None and dep != module and not module.startswith(dep + "."):
                # A package's __init__ is run when a submodule is imported: that edge is implied, not
                # a design choice, so only imports of modules outside one's own package chain count.
                graph[module].add(dep)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# The modules whose job is to reach into the ACP SDK's and asyncio's internals (their docstrings list
# them and a reload preflight checks they still exist): underscore attributes they use are not ours.
THIRD_PARTY_INTERNALS = ("daemon.agentctl.instance.acp_internals", "daemon.agentctl.instance.pipe_internals")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _private_uses(module: str, path: Path, own: set[str]) -> Iterator[str]:
    """Private imports from other product modules, and ``x._y`` on anything but ``self``/``cls``,
    except an underscore attribute the module itself defines (an object of one of its own classes,
    e.g. ``other._key`` in ``__eq__``, or a helper class reading its owner's state). Without types,
    ``ast`` cannot tell such an object from another module's object whose private attribute has the
    same name: give a private helper a name of its own rather than mirroring another module's."""
    tree = _tree(path)
    for target, name, line in _imports(module, path):
        if name is not None and _is_private(name) and _product(target) not in (None, module):
            yield f"{_shown(path)}:{line}: from {target} import {name}"
    if module in THIRD_PARTY_INTERNALS:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or node.attr in own:
                continue
            yield f"{_shown(path)}:{node.lineno}: {ast.unparse(node)}"


@functools.cache
def _own_private_attrs(path: Path) -> set[str]:
    """Underscore names a module defines on its own classes (``self._x = ...``, ``def _x``)."""
    tree = _tree(path)
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _is_private(node.name):
            own.add(node.name)
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own.update(t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id))
    return own


def test_modules_are_found() -> None:
    assert "daemon.backend.app" in MODULES
    assert "ipc.server" in MODULES
    assert len(MODULES) > 50


def test_no_import_cycle() -> None:
    """Issue 13 scenario B: no import cycle among the product modules."""
    cycles = _cycles(_graph())
    assert cycles == [], "import cycles among product modules:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _defined_privates() -> dict[str, set[str]]:
    """For each underscore name, the product modules that define it."""
    where: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for name in _own_private_attrs(path):
            where.setdefault(name, set()).add(module)
    return where


def _problems(module: str, path: Path, defined: dict[str, set[str]]) -> list[str]:
    out = []
    for problem in _private_uses(module, path, _own_private_attrs(path)):
        attr = problem.rsplit(".", 1)[-1]
        if " import " not in problem and not (defined.get(attr, set()) - {module}):
            continue  # a name no other product module defines: the standard library's or a package's
        out.append(problem)
    return out


def test_no_private_name_used_across_modules() -> None:
    """Issue 13 scenario B: no ``from X import _private`` across modules, no ``other._private``.

    ``other._x`` counts when ``_x`` is an underscore name some other product module defines.
    Underscore names of the standard library and third-party packages are out of scope here:
    ``os._exit`` is documented API, and the one module whose job is to reach into the ACP SDK's
    internals (``THIRD_PARTY_INTERNALS``) says so in its docstring."""
    defined = _defined_privates()
    problems = [p for module, path in MODULES.items() for p in _problems(module, path, defined)]
    assert problems == [], "private names used across modules:\n" + "\n".join(problems)


def test_the_checker_finds_a_planted_cycle_and_planted_private_uses(tmp_path: Path) -> None:
    """The checks can fail: a planted cycle, a private import and another module's private
    attribute are found; dunders, ``self._x`` and the standard library's ``os._exit`` are not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\n"
        "from daemon.backend.state.events import _now\n"
        "def f(servers, obj):\n"
        "    obj.__class__\n"
        "    os._exit\n"
        "    return servers._claim_loop\n"
        "class C:\n"
        "    def g(self):\n"
        "        return self._mine\n"
    )
    found = _problems("planted", planted, _defined_privates())
    assert len(found) == 2, found
    assert found[0].endswith("from daemon.backend.state.events import _now")
    assert found[1].endswith("servers._claim_loop")


def test_every_module_has_a_layer_and_entries_name_packages() -> None:
    """Issue 43: the table covers every module; an entry names a package, or a module at the top of
    ``daemon/``, ``daemon/agentctl/`` or ``daemon/backend/``."""
    assert [m for m in MODULES if layer_of(m) is None] == []
    for entry in LAYERS:
        path = ROOT / Path(*entry.split("."))
        is_package = (path / "__init__.py").is_file()
        assert is_package or (path.with_suffix(".py").is_file() and entry.rpartition(".")[0] in TOPS), entry


def test_no_upward_import() -> None:
    """Issue 43 scenario B: a module imports only its own layer entry or lower layers."""
    problems = upward_imports(_graph())
    assert problems == [], "imports against the layering (tests/unit/test_module_structure.py LAYERS):\n" + \
        "\n".join(problems)


def test_the_layer_check_finds_a_planted_upward_import() -> None:
    """Issue 43 scenario B: the check fails on an upward import. The real graph with one planted edge
    (the store importing the backend's session service, and a control-server module importing the
    backend) is refused; the real graph alone passes (test_no_upward_import)."""
    graph = {m: set(deps) for m, deps in _graph().items()}
    graph["daemon.store.transitions"].add("daemon.backend.sessions.sessions")
    graph["daemon.agentctl.instance.instance"].add("daemon.backend.state.executions")
    problems = upward_imports(graph)
    assert len(problems) == 2, problems
    assert problems[0].startswith("daemon.agentctl.instance.instance (daemon.agentctl.instance, layer 13) imports "
                                  "daemon.backend.state.executions")
    assert problems[1].startswith("daemon.store.transitions (daemon.store, layer 4)")
    # a sub-package importing the package's top (its composition root) is upward too
    graph = {"daemon.backend.sessions.sessions": {"daemon.backend.app"}, "daemon.backend.app": set()}
    assert len(upward_imports(graph)) == 1


def test_no_folder_is_a_flat_list() -> None:
    """Issue 43 scenario A: no folder holds more than 15 Python modules (a package's ``__init__.py``
    is the package itself, not one of its modules); ``daemon/`` holds no loose module but its entry
    points and ``__init__.py``."""
    crowded = {}
    for pkg in PACKAGES:
        for folder in [ROOT / pkg, *sorted(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]:
            rel = folder.relative_to(ROOT).as_posix() + "/"
            if "__pycache__" in rel or any(rel.startswith(prefix) for prefix in EXCLUDED):
                continue
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES_PER_FOLDER:
                crowded[rel] = count
    assert crowded == {}
    assert {p.name for p in (ROOT / "daemon").glob("*.py")} == DAEMON_ENTRY_POINTS
