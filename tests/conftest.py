"""Fixtures shared by tests/unit, tests/integration and tests/systemd (helpers: tests/helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT, venv_python_path


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The checkout's root directory (where pyproject.toml is)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> Path:
    """The dev venv's python (has kandev installed editable, plus its dependencies)."""
    py = venv_python_path()
    if not py.exists():
        pytest.fail(f"no dev venv python at {py}: run `bash packaging/dev/setup.sh` first", pytrace=False)
    return py
