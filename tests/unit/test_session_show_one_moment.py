"""``session show`` reports the session's state and whether its agent is live as of one moment.

The stored row is read off the event loop (a transcript page can be large). A launch commits the
session's new state and starts tracking its agent in one step of the loop, and that step could
fall during the read: the answer then paired the old state (STARTING) with the new execution
(live), which a CI run caught once. ``show`` reads again when tracking changed meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from daemon.backend.sessions.sessions import SessionService
from daemon.backend.state.agent_identity import AgentIdentity
from daemon.backend.views.session_view import PageRequest
from daemon.store.db import Store, sqlite_url
from daemon.store.models import TaskSession
from tests.support.store_rows import new_session


def test_a_launch_that_lands_during_the_read_is_seen_whole(tmp_path: Path) -> None:
    store = Store.open(sqlite_url(tmp_path / "kandev.db"))
    sid = new_session(store, "STARTING")
    executions: dict[str, Any] = {}
    backend = SimpleNamespace(store=store, executions=SimpleNamespace(executions=executions, guards={}),
                              report=SimpleNamespace(not_retracked={}), quiet_report=lambda _sid, _agent: None,
                              servers=SimpleNamespace(client_for=lambda ex: None))  # no server to ask about the network
    service = SessionService(backend, launcher=None)  # type: ignore[arg-type]  # show() needs neither
    real_read = service._read_session
    reads: list[str] = []

    async def scenario() -> dict[str, Any]:
        loop = asyncio.get_running_loop()

        def launch() -> None:  # what a launch does in one step of the loop: commit, then track
            with store.session() as db:
                row = db.get(TaskSession, sid)
                assert row is not None
                row.state = "WAITING_FOR_INPUT"
            executions[sid] = SimpleNamespace(agent=AgentIdentity(1234, 1.0, "b:1"), instance_id="i",
                                              retracked=False)

        def read_during_a_launch(session_id: str, request: PageRequest) -> Any:
            stored = real_read(session_id, request)
            reads.append(stored.session.state)
            if len(reads) == 1:  # the launch lands after this read, before show() looks at tracking
                landed = threading.Event()
                loop.call_soon_threadsafe(lambda: (launch(), landed.set()))
                assert landed.wait(10)
            return stored

        service._read_session = read_during_a_launch  # type: ignore[method-assign]
        return await service.show(sid, PageRequest())

    try:
        shown = asyncio.run(scenario())
    finally:
        store.close()
    assert reads == ["STARTING", "WAITING_FOR_INPUT"]
    assert (shown["state"], shown["live"], shown["agent_pid"]) == ("WAITING_FOR_INPUT", True, 1234)
