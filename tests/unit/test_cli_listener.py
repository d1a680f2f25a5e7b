"""``CliListener``: the backend's CLI socket handed from one server to the next, never missing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from daemon.backend.lifetime.cli_listener import CliListener
from ipc import AsyncClient, ConnectionContext, IpcServer, Op, OpTable

TABLE = OpTable("t", (1, 0), [Op("who", auth=False)])


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return run / "backend.sock"


def _server(path: Path, name: str) -> IpcServer:
    def who(ctx: ConnectionContext, args: dict[str, Any]) -> str:
        return name

    return IpcServer(path, TABLE, {"who": who})


def test_a_client_connecting_between_two_servers_is_served_by_the_next(sock_path: Path) -> None:
    async def main() -> None:
        listener = CliListener()
        first = _server(sock_path, "first")
        await listener.serve(first)  # binds
        inode = os.stat(sock_path).st_ino
        async with await AsyncClient.connect(sock_path) as c:
            assert await c.call("who") == "first"
        await listener.hand_over(first)
        assert listener.held and os.stat(sock_path).st_ino == inode  # the file stays, the same socket
        waiting = asyncio.ensure_future(AsyncClient.connect(sock_path, timeout=10))  # in the backlog
        await asyncio.sleep(0)
        second = _server(sock_path, "second")
        await listener.serve(second)
        assert not listener.held
        async with await waiting as c:
            assert await c.call("who") == "second"
        await second.close()
        assert not sock_path.exists()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_release_closes_a_held_listener_and_removes_its_file(sock_path: Path) -> None:
    async def main() -> CliListener:
        listener = CliListener()
        server = _server(sock_path, "only")
        await listener.serve(server)
        await listener.hand_over(server)
        return listener

    listener = asyncio.run(asyncio.wait_for(main(), 20))
    assert sock_path.exists()
    listener.release()
    assert not sock_path.exists() and not listener.held
    listener.release()  # nothing held: nothing to do
