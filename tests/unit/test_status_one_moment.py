"""``status`` reports the backend's state and its control server as of one moment.

A status asked while startup recovery finishes used to read the server (none yet) before its
questions to the control server, the sandbox and the store, and the state (READY by then) after
them: ``kandev up`` took that answer as ready and gave a caller a ready backend without a control
server, which a CI run of the version-skew test caught once. The state is now read with the server,
and the status asks again once if the server changed while its questions were out.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from daemon.api.ops import BackendState
from daemon.backend.control.launcher import ControlServerHandle
from daemon.backend.handlers import status as status_api
from daemon.backend.sessions import agent_launch
from ipc.server import ConnectionContext


def _backend() -> SimpleNamespace:
    link = SimpleNamespace(snapshot=lambda: {"state": "starting"})
    report = SimpleNamespace(retracked=[], not_retracked={}, stopped_with_backend=[], stopped_orphans=[],
                             duration_ms=0.0, adoption=SimpleNamespace(outcome="adopted", reason=None))
    backend = SimpleNamespace(
        state=BackendState.STARTING, handle=None, link=link, passthrough_link=link, passthrough_handle=None,
        servers=SimpleNamespace(server_identity="s"), launcher=SimpleNamespace(mode="detached"),
        report=report, executions=SimpleNamespace(executions={}), socket_path="/x",
        paths=SimpleNamespace(home="/h"), config=SimpleNamespace(source=None, agents=SimpleNamespace(max_memory=None, settings={}),
                              features=SimpleNamespace(auto_resume=True)),
        capability=SimpleNamespace(state="enabled", reason=None, detail=None, supervisor=None))

    async def store_status() -> dict[str, Any]:
        return {}

    backend.store_care = SimpleNamespace(status=store_status)
    return backend


def _status(backend: SimpleNamespace, upgrade: SimpleNamespace) -> dict[str, Any]:
    op_status = status_api.handlers(backend, upgrade)["status"]  # type: ignore[arg-type]
    return asyncio.run(op_status(ConnectionContext.__new__(ConnectionContext), {}))


def _server(pid: int) -> ControlServerHandle:
    return ControlServerHandle(endpoint=f"/run/agentctl-{pid}.sock", mode="detached", credential_ref="c",
                               log_path="l", pid=pid)


def test_a_start_that_finishes_during_a_status_is_not_reported_ready_without_its_server(monkeypatch) -> None:
    backend = _backend()
    asked: list[int] = []

    async def sandbox_status(b: Any) -> dict[str, Any]:
        asked.append(1)
        if len(asked) == 1:  # startup recovery finishes while the status's questions are out
            b.handle, b.state = _server(4242), BackendState.READY
        return {}

    monkeypatch.setattr(agent_launch, "sandbox_status", sandbox_status)
    first = _status(backend, SimpleNamespace(status=lambda: {}))
    # asked again with the server: ready, and the server's pid beside it
    assert first["backend"]["state"] == BackendState.READY and first["control_server"]["pid"] == 4242
    assert len(asked) == 2


def test_a_server_replaced_during_a_status_is_reported_with_its_own_identity_and_version(monkeypatch) -> None:
    """A replace-when-idle that finishes while a status is out sets the new handle, identity and
    version together: the reply pairs the new pid with the new identity and version, never the old
    pid with the new ones."""
    backend = _backend()
    backend.state, backend.handle = BackendState.READY, _server(1001)
    backend.servers.server_identity = "old"
    versions = {"running_version": "0.2.0"}
    asked: list[int] = []

    async def sandbox_status(b: Any) -> dict[str, Any]:
        asked.append(1)
        if len(asked) == 1:
            b.handle, b.servers.server_identity = _server(2002), "new"
            versions["running_version"] = "0.3.0"
        return {}

    monkeypatch.setattr(agent_launch, "sandbox_status", sandbox_status)
    reply = _status(backend, SimpleNamespace(status=lambda: dict(versions)))["control_server"]
    assert (reply["pid"], reply["server_identity"], reply["running_version"]) == (2002, "new", "0.3.0")
