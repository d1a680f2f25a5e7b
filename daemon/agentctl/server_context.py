"""The shared state of one control-server launch, which every service and handler module reads.

``ServerContext`` owns what is not any one operation's business: the per-launch identity and
settings, the ownership state machine (``daemon.agentctl.ownership``), the table of instances,
the turn-id source, the exit request, the reload history, the lock held around work done in
threads, the background tasks and the connection numbering of the debug log. It holds no
operation's logic: ``daemon.agentctl.server`` builds it, the services (``instances``,
``sandbox_host``, ``connection_auth``, ``reload_status``) act on it and the ``*_api`` modules
answer the wire with them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from daemon.agentctl.handover import ReloadHistory
from daemon.agentctl.instance.conversation import TurnIds
from daemon.agentctl.instance.instance import Instance
from daemon.agentctl.launch import LaunchConfig
from daemon.agentctl.ownership import Ownership
from daemon.config.agentctl import ResolvedAgentctl
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.server import IpcServer

log = logging.getLogger("kandev.agentctl.server")


class ServerContext:
    """Everything one launch's services and handlers share (see the module docstring)."""

    def __init__(
        self,
        config: LaunchConfig,
        resolved: ResolvedAgentctl,
        credential: bytes,
        *,
        on_instances_changed: Callable[[int], None] | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.server_identity = secrets.token_hex(16)
        self.installation_id = config.installation_id
        self.unowned_period_s = float(resolved.unowned_period)
        self.detached_event_limit = int(resolved.detached_event_limit)
        # Credentials, rotation and the unowned timer; a spawn without a handshake counts from
        # process start (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8).
        self.ownership = Ownership(credential, self.unowned_period_s, clock=time.monotonic)
        self.exit_requested = asyncio.Event()
        self.exit_reason: str | None = None
        self.shutdown_calls = 0  # ownership_shutdown handlers still to answer
        self.instances: dict[str, Instance] = {}
        self.turn_ids = TurnIds(self.server_identity)
        self.handshake_timeout = handshake_timeout
        self.reload_history = ReloadHistory(started_at=time.time())
        self.reloader: Any = None  # daemon.agentctl.reload.reexec.Reloader, set by main (None: reload refused)
        # Held around work done in threads (agent log bounds, sandbox probes): a re-exec takes it, so
        # no thread is half way through a file, or has a trial sandbox running, when the process
        # image is replaced (a thread's child would lose its parent-death tie with the thread).
        self.background_io = asyncio.Lock()
        self.ipc: IpcServer | None = None  # set by the composition root once the listener is built
        self._on_instances_changed = on_instances_changed
        self._conn_counter = 0
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def shutting_down(self) -> bool:
        """The one-way latch (AC-EXECUTORS-CONTROL-OWNERSHIP-003.9): set by the unowned decision, ownership_shutdown or a signal."""
        return self.ownership.shutting_down

    def connections(self) -> Iterable[ConnectionContext]:
        return self.ipc.connections if self.ipc is not None else ()

    def request_exit(self, reason: str) -> None:
        if self.exit_reason is None:
            self.exit_reason = reason
        self.exit_requested.set()

    def changed(self, _instance: Instance | None = None) -> None:
        """The number of instances may have changed: tell the launcher (systemd's STATUS=)."""
        if self._on_instances_changed is not None:
            try:
                self._on_instances_changed(len(self.instances))
            except Exception:
                log.exception("instance change callback failed")

    def conn_id(self, ctx: ConnectionContext) -> int:
        """A small number for one connection in the debug log."""
        conn_id = ctx.state.get("conn_id")
        if conn_id is None:
            self._conn_counter += 1
            conn_id = ctx.state["conn_id"] = self._conn_counter
        return conn_id

    def find(self, instance_id: str) -> Instance | None:
        """The instance, None if it is unknown or stopping."""
        inst = self.instances.get(instance_id)
        return None if inst is None or inst.gone else inst

    def get(self, instance_id: str) -> Instance:
        """The instance, ``not_found`` if it is unknown or stopping."""
        inst = self.find(instance_id)
        if inst is None:
            raise IpcError(ErrorCode.NOT_FOUND, f"no instance {instance_id!r}")
        return inst

    def refuse_if_shutting_down(self, op: str) -> None:
        if self.shutting_down:
            raise IpcError(ErrorCode.SHUTTING_DOWN, f"{op}: the control server is shutting down")

    def spawn_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()
