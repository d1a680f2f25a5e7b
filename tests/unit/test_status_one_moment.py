"""``status`` reports the backend's state and its control server as of one moment.

A status asked while startup recovery finishes used to read the server (none yet) before its
questions to the control server, the sandbox and the store, and the state (READY by then) after
them: ``kandev up`` took that answer as ready and gave a caller a ready backend without a control
server, which a CI run of the version-skew test caught once. The state is now read with the server.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from daemon.backend import agent_launch, status_api
from daemon.backend.api import BackendState
from daemon.backend.launcher import ControlServerHandle
from ipc.server import ConnectionContext


def _backend() -> SimpleNamespace:
    link = SimpleNamespace(snapshot=lambda: {"state": "starting"})
    report = SimpleNamespace(retracked=[], not_retracked={}, stopped_with_backend=[], stopped_orphans=[],
                             duration_ms=0.0, adoption=SimpleNamespace(outcome="adopted", reason=None))
    backend = SimpleNamespace(
        state=BackendState.STARTING, handle=None, link=link, passthrough_link=link, passthrough_handle=None,
        servers=SimpleNamespace(server_identity="s"), launcher=SimpleNamespace(mode="detached"),
        report=report, executions=SimpleNamespace(executions={}), socket_path="/x",
        paths=SimpleNamespace(home="/h"), config=SimpleNamespace(source=None),
        capability=SimpleNamespace(state="enabled", reason=None, detail=None, supervisor=None))

    async def store_status() -> dict[str, Any]:
        return {}

    backend.store_care = SimpleNamespace(status=store_status)
    return backend


def test_a_start_that_finishes_during_a_status_is_not_reported_ready_without_its_server(monkeypatch) -> None:
    backend = _backend()

    async def sandbox_status(b: Any) -> dict[str, Any]:
        # startup recovery finishes while the status's questions are out: server in use, ready
        b.handle = ControlServerHandle(endpoint="/run/agentctl.sock", mode="detached", credential_ref="c",
                                       log_path="l", pid=4242)
        b.state = BackendState.READY
        return {}

    monkeypatch.setattr(agent_launch, "sandbox_status", sandbox_status)
    upgrade = SimpleNamespace(status=lambda: {})
    op_status = status_api.handlers(backend, upgrade)["status"]  # type: ignore[arg-type]
    first = asyncio.run(op_status(ConnectionContext.__new__(ConnectionContext), {}))
    assert first["backend"]["state"] == BackendState.STARTING and first["control_server"]["pid"] is None
    second = asyncio.run(op_status(ConnectionContext.__new__(ConnectionContext), {}))
    assert second["backend"]["state"] == BackendState.READY and second["control_server"]["pid"] == 4242
