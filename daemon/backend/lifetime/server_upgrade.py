"""Keeping the control server on the installed version without stopping an agent (Issue 15).

The backend adopts a control server one release older as it adopts its own (adoption
needs only the capabilities release 0.1.0 had). Then, in the background once ready:

- a server that can reload (capability ``reload.v1``) and runs an older version than
  the one installed is asked to ``reload``: it re-executes the installed code in place,
  its agents untouched (``daemon.agentctl.reload.reexec``); the backend's streams and calls
  reconnect by themselves;
- a server that cannot (release 0.1.0, protocol 1.0) keeps serving its agents, and new
  sessions the agent-sandbox policy allows on it (it has no sandbox: with
  ``agents.sandbox = "required"`` a launch there is refused with ``sandbox_unavailable``,
  never started unsandboxed; ``AgentctlClient.create_instance``), and is **replaced once it
  runs no instance**: with no launch in flight and none allowed to start (``LaunchGate``),
  an empty ``list_instances`` is followed by its link's ``replace``
  (``daemon.backend.control.link``): the link stops watching it, so its end is no loss and
  no session is repaired for it, ``ownership_shutdown`` ends it (stopping nothing: there is
  nothing), and the link starts a fresh server of the installed version the way it restarts
  one. It is checked every ``IDLE_CHECK_S`` seconds. Its agents are never stopped for it;
  an operator who wants it replaced sooner ends or stops its sessions. If it dies meanwhile,
  that is a loss like any other, and the server its link starts is already current.

``reload()`` is also what ``kandev agentctl reload`` runs (backend op ``agentctl_reload``).
``status()`` is the ``control_server`` part of ``kandev status`` about versions: the
running version (None when the server cannot say: release 0.1.0), the installed one
(read from disk, so it is right even in a backend started before an upgrade), whether
the server can reload, its re-execution count and the last one's time, the last
reload's outcome, and a pending replacement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psutil

from daemon.agentctl.client.replies import ServerInfo
from daemon.agentctl.protocol import RELOAD_CAPABILITY
from daemon.api.ops import LinkState
from daemon.core.journal import log_event
from daemon.core.version import VERSION, installed_version, version_key
from ipc.aio import cancel_and_wait, within
from ipc.errors import ErrorCode, IpcError

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext

log = logging.getLogger(__name__)

IDLE_CHECK_S = 2.0
RELOAD_WAIT_S = 150.0
"""How long ``reload`` follows the server's re-exec (quiesce 15 s, preflight 60 s, a new image)."""
STATUS_READ_S = 2.0
REPLACE_UNIT_WAIT_S = 30.0


def _iso(ts: Any) -> str | None:
    if not isinstance(ts, int | float):
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


class ServerUpgrade:
    def __init__(self, backend: BackendContext) -> None:
        self.backend = backend
        self.info: ServerInfo | None = None  # the last server_info answer
        self.replacement: str | None = None  # "when_idle" while an old server waits to be replaced
        self.last_replaced: dict[str, Any] | None = None
        self.reloading = False  # a reload asked by this backend is under way (status says so)
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ state
    def _client(self) -> Any:
        client = self.backend.client
        if client is None:
            raise IpcError(ErrorCode.UNAVAILABLE, "the backend has no control server", True)
        return client

    @staticmethod
    def can_reload(client: Any) -> bool:
        return RELOAD_CAPABILITY in client.capabilities

    async def refresh(self, timeout: float = STATUS_READ_S) -> ServerInfo | None:
        client = self.backend.client
        if client is None or not self.can_reload(client):
            return None
        try:
            self.info = await within(client.server_info(timeout=timeout), timeout)
        except (IpcError, TimeoutError) as exc:
            log.debug("server_info failed: %s", exc)
        return self.info

    def status(self) -> dict[str, Any]:
        client = self.backend.client
        reload_info = (self.info.get("reload") if self.info else None) or {}
        can_reload = client is not None and self.can_reload(client)
        return {
            "version": (self.info.get("version") if self.info else None) if can_reload else None,
            "installed_version": installed_version(),
            "protocol_version": list(client.protocol_version) if client is not None else None,
            "can_reload": can_reload,
            "reexec_count": reload_info.get("reexec_count") if can_reload else None,
            "last_reexec_at": _iso(reload_info.get("last_reexec_at")),
            "last_reload": {
                "attempt": reload_info.get("last_attempt"),
                "outcome": reload_info.get("last_outcome"),
                "reason": reload_info.get("last_reason"),
                "at": _iso(reload_info.get("last_outcome_at")),
            } if reload_info.get("last_attempt") else None,
            "replacement": self.replacement,
            "last_replaced": self.last_replaced,
        }

    # ------------------------------------------------------------ after recovery
    def start(self) -> None:
        """In the background once the backend is ready: reload an older server that can, or
        watch one that cannot until it runs no instance."""
        if self._task is None and self.backend.enabled and self.backend.client is not None:
            self._task = asyncio.get_running_loop().create_task(self._keep_current(), name="server-upgrade")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _keep_current(self) -> None:
        client = self._client()
        installed = installed_version() or VERSION
        if self.can_reload(client):
            info = await self.refresh()
            running = info.get("version") if info else None
            if isinstance(running, str) and version_key(installed) > version_key(running):
                log_event("control_server_outdated", f"the control server runs {running}, {installed} is installed:"
                          " asking it to re-execute in place", RUNNING_VERSION=running, INSTALLED_VERSION=installed)
                with contextlib.suppress(IpcError):
                    await self.reload()
            return
        self.replacement = "when_idle"
        log_event("control_server_outdated", f"the control server predates in-place reload (protocol"
                  f" {'.'.join(map(str, client.protocol_version))}): it keeps serving its agents and is replaced by"
                  f" version {installed} once it runs no instance", RUNNING_VERSION="unknown",
                  INSTALLED_VERSION=installed, REASON="cannot_reload")
        while self.replacement is not None:
            await asyncio.sleep(IDLE_CHECK_S)
            current = self.backend.client
            if current is not None and self.can_reload(current):
                # it went away by itself and the link started the installed version in its place
                self.replacement = None
                break
            try:
                await self._replace_if_idle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # try again at the next check; agents are never touched
                log.warning("replacing the old control server failed: %s", exc)

    async def _replace_if_idle(self) -> bool:
        """Retire the old server through its link (``ControlServerLink.replace``: not a loss) once it
        runs no instance and no launch is in flight, and start the installed version the way the
        link restarts one (unit, detached or child; a fresh credential and record)."""
        b = self.backend
        async with b.launch_gate.exclusive():
            if b.link.state != LinkState.RUNNING or b.client is None:
                return False  # lost, restarting, gave up...: the link handles it
            if await b.client.list_instances():
                return False
            old_pid = b.handle.pid if b.handle is not None else None
            if not await b.link.replace(self._retire):
                return False
            self.replacement = None
            self.last_replaced = {"old_pid": old_pid, "new_pid": b.handle.pid if b.handle else None,
                                  "at": datetime.now(UTC).isoformat(timespec="seconds")}
            await self.refresh()
            log_event("control_server_replaced", f"the old control server (pid {old_pid}) ran no instance any more:"
                      f" replaced by version {(self.info.get('version') if self.info else None)} (pid {self.last_replaced['new_pid']})",
                      OLD_PID=old_pid, NEW_PID=self.last_replaced["new_pid"])
            return True

    async def _retire(self, attached: Any) -> None:
        """End the old server: ``ownership_shutdown`` (it stops nothing: it runs no instance), then
        forget it and remove what this backend wrote for it once it is gone."""
        b = self.backend
        old, handle = attached.client, attached.handle
        stopped = await old.ownership_shutdown()
        if stopped.get("stopped"):  # cannot happen with no instance and no launch: say so loudly
            log_event("control_server_replace_stopped", f"ownership_shutdown stopped {stopped['stopped']}",
                      priority=3)
        claims = b.claim_tasks.pop(old.socket_path, None)
        if claims is not None:
            await cancel_and_wait(claims)
        with contextlib.suppress(Exception):
            await old.close()
        b.servers.survival.client = None
        if await self._wait_gone(handle.pid):
            b.launcher.remove_files(handle)

    async def _wait_gone(self, pid: int | None) -> bool:
        """Wait (bounded) until ``pid`` has exited; True once it has."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPLACE_UNIT_WAIT_S
        while pid is not None and loop.time() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                return True
            await asyncio.sleep(0.1)
        return pid is None

    # ------------------------------------------------------------ reload
    async def reload(self) -> dict[str, Any]:
        """Ask the server to re-execute the installed code and follow it to its outcome."""
        client = self._client()
        if not self.can_reload(client):
            raise IpcError(
                "reload_unsupported",
                "the control server predates in-place reload (protocol"
                f" {'.'.join(map(str, client.protocol_version))}): it keeps serving its agents and is replaced"
                " once it runs no instance",
                False,
            )
        self.reloading = True
        try:
            return await self._reload(client)
        finally:
            self.reloading = False

    async def _reload(self, client: Any) -> dict[str, Any]:
        before = await client.server_info()
        started = await client.reload()
        attempt = int(started["attempt"])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELOAD_WAIT_S
        info = before
        while loop.time() < deadline:
            await asyncio.sleep(0.1)
            info = await client.server_info()  # reconnects by itself across the re-exec
            status = info.get("reload") or {}
            if int(status.get("last_attempt") or 0) >= attempt and not status.get("in_progress"):
                break
        else:
            raise IpcError(ErrorCode.TIMEOUT, f"reload {attempt}: no outcome within {RELOAD_WAIT_S:g} s")
        self.info = info
        status = info["reload"]
        result = {
            "attempt": attempt,
            "outcome": status.get("last_outcome"),
            "reason": status.get("last_reason"),
            "pid": info.get("pid"),
            "pid_before": before.get("pid"),
            "version_before": before.get("version"),
            "version": info.get("version"),
            "installed_version": installed_version(),
            "reexec_count": status.get("reexec_count"),
            "pause_ms": status.get("last_pause_ms"),
        }
        log_event("control_server_reload", f"reload {attempt} of the control server: {result['outcome']}"
                  f" ({result['version_before']} -> {result['version']})"
                  + (f": {result['reason']}" if result["reason"] else ""),
                  priority=5 if result["outcome"] == "reexecuted" else 3,
                  OUTCOME=str(result["outcome"]), ATTEMPT=attempt, VERSION=str(result["version"]))
        return result
