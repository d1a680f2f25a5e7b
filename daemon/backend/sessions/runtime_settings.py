"""Runtime configuration of a session with a live agent: ``session_configure``
(``kandev session configure SID --model M --mode X --option ID=V``).

The target is normalized against what the agent announced (its catalogue of models, modes and
options), applied through ACP (``daemon.backend.sessions.runtime_config.apply_config``), and only what the
agent accepted is stored (RESETCFG-8), once the event consumer has caught up with the events the
agent sent before its answers (``LiveSessions.converge``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions import runtime_config as rc
from daemon.backend.sessions.live import InstanceAgent, LiveSessions, conflict, put_runtime
from daemon.backend.sessions.sessions import get_session
from daemon.core.journal import log_event
from daemon.store.session_metadata import SessionMetadata
from daemon.store.states import SessionState
from ipc.errors import ErrorCode, IpcError


class RuntimeSettings:
    def __init__(self, backend: BackendContext, live: LiveSessions) -> None:
        self.backend = backend
        self.live = live

    async def configure(self, session_id: str, model: str | None, mode: str | None,
                        options: Mapping[str, rc.OptionValue]) -> dict[str, Any]:
        b = self.backend
        b.executions.check_launch(session_id)
        async with self.live.lock(session_id):
            ex = self.live.live_execution(session_id)
            with b.store.session() as db:
                session = get_session(db, session_id)
                if session.state not in (SessionState.WAITING_FOR_INPUT, SessionState.RUNNING):
                    raise conflict(f"session {session_id} is {session.state}")
                meta = SessionMetadata.load(session)
            catalogue = await self.live.catalogue(session_id, meta)
            for option_id in options:
                if catalogue.carries_model_or_mode(option_id):
                    raise IpcError(ErrorCode.INVALID_ARGUMENT,
                                   f"option {option_id!r} is the model or the mode: use --model / --mode")
            target = rc.normalize(model, mode, options, catalogue)
            if target.empty:
                raise IpcError(ErrorCode.INVALID_ARGUMENT, "nothing to configure: give --model, --mode or --option")
            base = self.live.reported_over(meta.runtime_config, catalogue)
            agent = InstanceAgent(self.live.client(ex), ex.instance_id)
            try:
                applied = await rc.apply_config(target, agent, catalogue, base)
            except rc.ApplyRejected as rej:
                await self.live.converge(ex, rej.last_seq)
                self.store_runtime(session_id, rej.accepted, rej.catalogue)
                raise IpcError(ErrorCode.AGENT_ERROR,
                               f"{rej}; accepted so far: {json.dumps(rej.accepted.to_json(), sort_keys=True)}",
                               False) from None
            await self.live.converge(ex, applied.last_seq)
            self.store_runtime(session_id, applied.accepted, applied.catalogue)
            log_event("session_configured", f"session {session_id} runtime configuration: "
                      f"{json.dumps(applied.accepted.to_json(), sort_keys=True)}", SESSION_ID=session_id)
            return {"session_id": session_id, "runtime_config": applied.accepted.to_json(),
                    "calls": [list(c) for c in applied.calls]}

    def store_runtime(self, session_id: str, value: rc.SessionRuntimeConfig, catalogue: rc.Catalogue) -> None:
        with self.backend.store.session() as db:
            session = get_session(db, session_id)
            meta = SessionMetadata.load(session)
            put_runtime(meta, value, catalogue)
            meta.save(session)
        self.live.configs[session_id] = value
        if catalogue.known:
            self.live.catalogues[session_id] = catalogue
