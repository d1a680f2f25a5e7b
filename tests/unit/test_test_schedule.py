"""The suite's longest-first module order (tests/support/schedule.py) names modules that exist,
each once, and the runner keeps that order (test.sh passes ``--no-loadscope-reorder``)."""

from __future__ import annotations

from tests.support.paths import REPO_ROOT
from tests.support.schedule import LONGEST_FIRST


def test_every_listed_module_exists_once() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [m for m in LONGEST_FIRST if not (REPO_ROOT / m).is_file()]
    assert missing == [], f"tests/support/schedule.py names modules that are gone: {missing}"


def test_the_runner_keeps_the_collection_order() -> None:
    assert "--no-loadscope-reorder" in (REPO_ROOT / "packaging" / "dev" / "test.sh").read_text()
