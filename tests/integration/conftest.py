"""Fixtures of the integration tests (helpers: tests/support).

``kandev_factory`` makes ``Kandev`` drivers (tests/support/kandev.py), each on a private home
under one short temporary directory, and cleans every one up at teardown: ``kandev down``, then
SIGTERM/SIGKILL of exactly the pids and process groups it saw. ``short_tmp`` is a private
directory with a short path (Unix socket paths are limited to 107 bytes). When a test fails, its
homes' logs and stores are kept first (tests/support/failed_homes.py). ``server``
is a real control server in a ``short_tmp`` (tests/support/agentctl.py), stopped with every
agent group it started; a module that needs another kind of server defines its own ``server``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import failed_homes
from tests.support.agentctl import Server, start_server, stop_server, write_launch
from tests.support.kandev import Kandev, make_env

_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Remember whether the test itself failed (its fixtures' teardown reads it)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private directory with a short path (Unix socket paths are limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="kd-", dir="/var/tmp") as d:
        os.chmod(d, 0o700)
        yield Path(d)


@pytest.fixture
def kandev_factory(request: pytest.FixtureRequest, short_tmp: Path) -> Iterator[Any]:
    made: list[Kandev] = []

    def make(name: str = "home", config_text: str = "", **env: str) -> Kandev:
        config = short_tmp / f"{name}.toml"
        config.write_text(config_text)
        k = Kandev(short_tmp / name, make_env(config, **env))
        made.append(k)
        return k

    yield make
    if request.node.stash.get(_CALL_FAILED, False):
        kept = failed_homes.keep(request.node.nodeid, os.getpid(), [k.home for k in made])
        if kept is not None:
            print(f"the daemons' logs and stores of this failed test are kept in {kept}")
    for k in made:
        k.cleanup()


@pytest.fixture
def server(short_tmp: Path) -> Iterator[Server]:
    """A real control server (``python -m daemon.agentctl.main``) in ``short_tmp``."""
    srv = write_launch(short_tmp)
    try:
        start_server(srv)
        yield srv
    finally:
        stop_server(srv)
