"""The `sdbox` fixture: one throw-away systemd (tests/systemd/sdbox.sh) per test module.

Helper API (see tests.support.sdbox.SdBox): run, systemctl, prop, journal_json, alive, wait_for, write_file,
read_file, install_units; attributes leader, lab, share (host side of /sdbox), venv_bin, repo_root.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.sdbox import SdBox, SdBoxError, on_ci, unavailable_reason

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # every test under tests/systemd gets the `systemd` marker (select with -m systemd / -m "not systemd")
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.systemd)


@pytest.fixture(scope="module")
def sdbox(repo_root: Path, venv_python: Path) -> Iterator[SdBox]:
    """A booted systemd 252 box for this test module; torn down (bounded) after its last test.

    Skips with the reason when the harness cannot run here; with CI=true it fails instead.
    """
    reason = unavailable_reason()
    if reason:
        if on_ci():
            pytest.fail(f"systemd tests cannot run on this CI machine: {reason}", pytrace=False)
        pytest.skip(f"systemd harness (tests/systemd/sdbox.sh) unavailable: {reason}")
    box = SdBox(repo_root=repo_root, venv_bin=venv_python.parent)
    try:
        box.start()
    except SdBoxError as e:
        pytest.fail(f"could not boot the systemd box: {e}", pytrace=False)
    try:
        problems = box.visibility_problems()
        assert not problems, (
            "the box (an overlay of the host's /, but with its own empty /tmp) must see the checkout "
            "and the venv at the same paths; keep the venv outside /tmp (packaging/dev/setup.sh does, "
            "or set KANDEV_VENV): " + "; ".join(problems)
        )
        yield box
    finally:
        box.stop()
