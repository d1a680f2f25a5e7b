"""Issue 13 scenario D: session start, resume and restart-reset share one launch pipeline.

Read from the source with ``ast`` (nothing is imported or run): the three entry points call
``SessionLauncher.launch`` (credentials, then ``create_instance`` under the launch gate), write the
inventory row with ``record_live``, and announce WAITING_FOR_INPUT with ``ready``; and no other
backend module creates an instance or an inventory row, so a fourth, private copy of the pipeline
cannot appear unnoticed. What each path does is proven end to end by the integration tests of
start (``tests/integration/test_cli.py``), resume (``test_resume.py``) and context reset with
``--restart`` (``test_runtime_config.py``), all of which now run through this pipeline.
"""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parents[2] / "daemon" / "backend"
PIPELINE = BACKEND / "sessions" / "launcher.py"


def _method(path: Path, cls: str, name: str) -> ast.AST:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{path.name}: no {cls}.{name}")


def _launcher_calls(node: ast.AST) -> set[str]:
    """The ``self.launcher.X(...)`` calls made anywhere inside ``node``."""
    calls: set[str] = set()
    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                and isinstance(sub.func.value, ast.Attribute) and sub.func.value.attr == "launcher"):
            calls.add(sub.func.attr)
    return calls


def _class_calls(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return _launcher_calls(node)
    raise AssertionError(f"{path.name}: no class {cls}")


def test_the_three_entry_points_launch_through_the_pipeline() -> None:
    """Issue 13 scenario D: start, resume and restart-reset each call ``SessionLauncher.launch``."""
    start = _method(BACKEND / "sessions" / "sessions.py", "SessionService", "start")
    resume = _method(BACKEND / "sessions" / "resume.py", "ResumeService", "resume")
    restart = _method(BACKEND / "sessions" / "context_reset.py", "ContextReset", "_new_provider_session")
    for entry in (start, resume, restart):
        assert "launch" in _launcher_calls(entry)
    # ... and each finishes through the pipeline's steps 3-5 (row, WAITING_FOR_INPUT, tracking).
    assert {"record_live", "ready", "track"} <= _launcher_calls(start)
    assert {"record_live", "ready", "track"} <= _class_calls(BACKEND / "sessions" / "resume.py", "ResumeService")
    assert {"record_live", "ready", "track"} <= _class_calls(BACKEND / "sessions" / "context_reset.py", "ContextReset")


def test_no_other_backend_module_creates_an_instance_or_an_inventory_row() -> None:
    """Issue 13 scenario D: ``create_instance`` and new ``ExecutorRunning`` rows only in the pipeline."""
    offenders: list[str] = []
    for path in sorted(BACKEND.rglob("*.py")):
        if path == PIPELINE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in ("create_instance", "ExecutorRunning"):
                offenders.append(f"{path.name}:{node.lineno}: {name}")
    assert offenders == []
    pipeline_calls = {
        (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
        for node in ast.walk(ast.parse(PIPELINE.read_text())) if isinstance(node, ast.Call)
    }
    assert {"create_instance", "ExecutorRunning", "prepare", "prepare_relaunch", "agent_command"} <= pipeline_calls
