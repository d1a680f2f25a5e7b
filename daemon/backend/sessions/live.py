"""What resume, runtime configuration and context reset share about sessions with a live agent.

``LiveSessions`` holds the per-session locks (one resume, configure or reset of a session at a
time) and this backend lifetime's caches of each session's runtime configuration: what the agent
accepted or reported (RESETCFG-2) and the catalogue of models, modes and options it announced.
Runtime state is written only from answers the agent accepted or from the events it sends
(RESETCFG-8); before writing, the backend waits (``converge``) until its event consumer has applied
every event the agent sent before its answer, so a late event cannot overwrite a newer value.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from daemon.agentctl.client.connection import AgentctlClient
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.sessions import runtime_config as rc
from daemon.backend.state.executions import Execution
from daemon.store import transcript
from daemon.store.session_metadata import SessionMetadata
from ipc.aio import cancel_and_wait
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("kandev.backend.resume")

CONVERGE_TIMEOUT_S = 5.0


def _now() -> datetime:
    return datetime.now(UTC)


def put_runtime(meta: SessionMetadata, value: rc.SessionRuntimeConfig, catalogue: rc.Catalogue) -> None:
    """Store a session's runtime configuration in its metadata, and the agent's catalogue if known."""
    meta.set_runtime_config(value.to_json())
    if catalogue.known:
        meta.set_acp_catalogue(catalogue.to_json())


def iso() -> str:
    return _now().isoformat().replace("+00:00", "Z")


def conflict(message: str, retryable: bool = False) -> IpcError:
    return IpcError(ErrorCode.CONFLICT, message, retryable)


class InstanceAgent:
    """``runtime_config.Agent`` bound to one control-server instance."""

    def __init__(self, client: AgentctlClient, instance_id: str) -> None:
        self.client = client
        self.instance_id = instance_id

    async def set_mode(self, mode_id: str) -> Mapping[str, Any]:
        return await self.client.set_mode(self.instance_id, mode_id)

    async def set_config_option(self, config_id: str, value: rc.OptionValue) -> Mapping[str, Any]:
        return await self.client.set_config_option(self.instance_id, config_id, value)


class LiveSessions:
    def __init__(self, backend: BackendContext) -> None:
        self.backend = backend
        self.locks: dict[str, asyncio.Lock] = {}
        # The live caches of this backend lifetime (RESETCFG-2): what the agent accepted or reported.
        self.configs: dict[str, rc.SessionRuntimeConfig] = {}
        self.catalogues: dict[str, rc.Catalogue] = {}

    def lock(self, session_id: str) -> asyncio.Lock:
        """The per-session lock resume, configure and context reset take."""
        return self.locks.setdefault(session_id, asyncio.Lock())

    def refuse_live(self, session_id: str) -> None:
        if session_id in self.backend.executions.executions:
            raise conflict(f"session {session_id} already has a live agent; resume is for sessions without one")

    def live_execution(self, session_id: str) -> Execution:
        ex = self.backend.executions.executions.get(session_id)
        if ex is None or ex.gone:
            raise conflict(f"session {session_id} has no running agent (resume it first: kandev resume)")
        return ex

    def client(self, ex: Execution) -> AgentctlClient:
        client = self.backend.servers.client_for(ex)
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "no control server", True)
        return client

    async def converge(self, ex: Execution, seq: int) -> None:
        """Wait (bounded) until the event consumer applied every event up to ``seq``."""
        if seq <= 0:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + CONVERGE_TIMEOUT_S
        while ex.last_seq < seq and not ex.gone and loop.time() < end:
            await asyncio.sleep(0.02)

    async def untrack(self, ex: Execution) -> None:
        """Stop consuming this execution's events and forget it (its instance is not stopped here)."""
        ex.gone = True
        self.backend.executions.executions.pop(ex.session_id, None)
        consumer = ex.consumer
        if consumer is not None and consumer is not asyncio.current_task() and not await cancel_and_wait(consumer):
            log.error("session %s: the event consumer did not stop within 5 s of being cancelled", ex.session_id)
        ex.fail_waiters("agent_exited")

    async def catalogue(self, session_id: str, meta: SessionMetadata) -> rc.Catalogue:
        """What the agent last reported about its session: this lifetime's cache, else the control
        server's live record of the instance, else what the store kept."""
        cat = self.catalogues.get(session_id)
        if cat is not None and cat.known:
            return cat
        ex = self.backend.executions.executions.get(session_id)
        if ex is not None:
            with contextlib.suppress(IpcError):
                for inst in await self.client(ex).list_instances():
                    if inst.get("instance_id") == ex.instance_id and (inst.get("config_options") or inst.get("modes")):
                        cat = rc.Catalogue.from_json(inst)
                        self.catalogues[session_id] = cat
                        return cat
        return rc.Catalogue.from_json(meta.acp_catalogue)

    @staticmethod
    def reported_over(stored: Any, catalogue: rc.Catalogue) -> rc.SessionRuntimeConfig:
        """The stored value with what the agent reports as current winning (RESETCFG-12)."""
        old = rc.SessionRuntimeConfig.from_json(stored, catalogue)
        if not catalogue.known:
            return old
        new = rc.provider_state(catalogue)
        return rc.SessionRuntimeConfig(
            model=new.model if new.model is not None else old.model,
            mode=new.mode if new.mode is not None else old.mode,
            options=dict(new.options) if catalogue.config_options else dict(old.options),
        )

    def message(self, db: Any, session_id: str, kind: str, payload: Mapping[str, Any]) -> None:
        transcript.append(db, session_id, role="system", kind=kind,
                          text=json.dumps(dict(payload), sort_keys=True, default=str))
