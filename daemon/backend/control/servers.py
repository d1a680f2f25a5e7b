"""The control servers one backend uses: the survival one and the passthrough one.

Each is a ``ServerSide``: its ``ControlServerLink`` (``daemon.backend.control.link``: watch, lose,
restart with back-off, give up), the ``Launcher`` that starts it, and while it runs its client and
handle. The survival server is started the way the installation's mode says (a systemd unit,
detached, or a child); passthrough sessions run on a server that is always the backend's child
(AC-EXECUTORS-SURVIVAL-005.3) and is started when the first one needs it.

``ControlServers`` also renews ownership of every server the backend uses (one claim loop per
endpoint, AC-EXECUTORS-CONTROL-OWNERSHIP-003.2), forgets a server another holder of the
installation's credential adopted (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3), and makes the sessions of a server that died truthful
(``server_lost``, the repair startup recovery also uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from daemon.agentctl.client.connection import AgentctlClient
from daemon.agentctl.client.handshake import OwnershipRefused, identify
from daemon.agentctl.client.replies import ServerIdentity
from daemon.api.ops import LinkState
from daemon.backend.cluster.identity import ClusterIdentity
from daemon.backend.control.launcher import ControlServerHandle, Launcher, UnitBusy
from daemon.backend.control.link import Attached, ControlServerLink, Loss
from daemon.backend.control.watch import ServerWatch
from daemon.backend.git.credential_endpoints import CredentialEndpoints
from daemon.backend.recovery.repair import LostAgent, repair_lost_server
from daemon.backend.state.executions import Execution, ExecutionStore
from daemon.config.settings import Config
from daemon.core.journal import log_event
from daemon.host.paths import Paths
from daemon.store.db import Store
from daemon.store.models import ControlServerRecord
from daemon.store.states import LaunchMode
from ipc.aio import cancel_and_wait
from ipc.errors import ErrorCode, IpcError

log = logging.getLogger("daemon.backend.app")


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class ServerSide:
    """One control server the backend uses (survival or passthrough)."""

    link: ControlServerLink
    launcher: Launcher
    client: AgentctlClient | None = None
    handle: ControlServerHandle | None = None


class ControlServers:
    """The survival and the passthrough control server of one backend lifetime."""

    def __init__(self, paths: Paths, config: Config, installation_id: str, mode: LaunchMode, store: Store,
                 executions: ExecutionStore, endpoints: CredentialEndpoints,
                 on_gone: Callable[[Execution], None]) -> None:
        self.paths = paths
        self.config = config
        self.installation_id = installation_id
        self.store = store
        self.executions = executions
        self.endpoints = endpoints
        self.on_gone = on_gone
        self.server_identity: str | None = None
        self.credential: bytes | None = None  # current ownership credential (memory + 0600 file only)
        self.claim_tasks: dict[str, asyncio.Task[None]] = {}  # endpoint -> its renewal loop
        self.fallback_reason: str | None = None
        self.first_failure: str | None = None  # why startup could not start a control server
        # Sessions a lost server interrupted, once a new one runs (the automatic resume, when wired).
        self.on_restarted: Callable[[list[str]], None] | None = None
        self.survival = ServerSide(
            ControlServerLink("survival", start=self.restart_own_server, on_restarted=self._restarted,
                              on_lost=lambda attached, loss: self.server_lost(attached, loss, passthrough=False)),
            Launcher(paths, config, installation_id, mode))
        # Passthrough sessions run on a control server that is always our child
        # (AC-EXECUTORS-SURVIVAL-005.3): it dies with the backend whatever the switch says.
        self.passthrough = ServerSide(
            ControlServerLink("passthrough", start=self.start_passthrough_server, on_restarted=self._restarted,
                              on_lost=lambda attached, loss: self.server_lost(attached, loss, passthrough=True)),
            Launcher(paths, config, installation_id, LaunchMode.CHILD))

    # The survival side's parts under the names the rest of the backend has always used.
    @property
    def client(self) -> AgentctlClient | None:
        return self.survival.client

    @property
    def handle(self) -> ControlServerHandle | None:
        return self.survival.handle

    @property
    def link(self) -> ControlServerLink:
        return self.survival.link

    @property
    def launcher(self) -> Launcher:
        return self.survival.launcher

    def side(self, passthrough: bool) -> ServerSide:
        return self.passthrough if passthrough else self.survival

    def client_of(self, passthrough: bool) -> AgentctlClient | None:
        return self.side(passthrough).client

    def handle_of(self, passthrough: bool) -> ControlServerHandle | None:
        return self.side(passthrough).handle

    def client_for(self, ex: Execution) -> AgentctlClient | None:
        """The client of the server an execution runs on (None while it has none)."""
        return self.client_of(ex.passthrough)

    def _restarted(self, session_ids: list[str]) -> None:
        if self.on_restarted is not None:
            self.on_restarted(session_ids)

    # ------------------------------------------------------------ ownership
    def superseded(self, client: AgentctlClient) -> None:
        """An operation was refused for a superseded credential: another holder of this
        installation's credential adopted the server. Its executions are no longer ours: forget
        them, stop renewing, and never retry; nothing is stopped (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3)."""
        client.on_superseded = None  # once
        passthrough = client is self.passthrough.client
        self.release_link(client.socket_path)  # not ours: neither watched nor restarted
        lost = [ex for ex in self.executions.executions.values() if ex.passthrough == passthrough]
        for ex in lost:
            ex.gone = True
            self.on_gone(ex)
            ex.fail_waiters("superseded_credential")
            if ex.consumer is not None:
                ex.consumer.cancel()
        claims = self.claim_tasks.pop(client.socket_path, None)
        if claims is not None:
            claims.cancel()
        log_event("ownership_lost", f"control server at {client.socket_path} was adopted with this installation's"
                  f" credential by someone else: {len(lost)} execution(s) no longer tracked, nothing stopped",
                  priority=4, REASON="superseded_credential", COUNT=len(lost))

    async def connect(self, handle: ControlServerHandle, credential: bytes) -> tuple[AgentctlClient, ServerIdentity]:
        info = await identify(handle.endpoint, timeout=5.0)
        if info is None:
            raise IpcError(ErrorCode.UNAVAILABLE, f"control server at {handle.endpoint} does not answer")
        client = await AgentctlClient.connect(
            handle.endpoint,
            credential=credential,
            installation_id=self.installation_id,
            expected_identity=info["server_identity"],
        )
        await client.claim()
        return client, info

    async def start_own_server(self) -> AgentctlClient:
        """Start a fresh control server and record it as the one this installation uses.

        Under systemd the unit can hold only one server: if it runs one this backend
        could not adopt, that server is never stopped (AC-EXECUTORS-CONTROL-OWNERSHIP-001.4)
        and this backend uses a child server until the survivor's unowned shutdown.
        """
        try:
            handle, credential = await self.survival.launcher.start()
        except UnitBusy as exc:
            self.fallback_reason = str(exc)
            log_event("control_server_fallback", f"{exc}; using a control server bound to this backend",
                      priority=4, REASON="unit_busy")
            handle, credential = await self.passthrough.launcher.start()
        client, info = await self.connect(handle, credential)
        self.credential = credential
        self.start_claims(client, handle.endpoint, info["server_identity"], credential)
        self.survival.handle = handle
        self.server_identity = info["server_identity"]
        with self.store.session() as db:
            identity = ClusterIdentity.of(self.config)
            rec = identity.record(db) or identity.new_record(db)
            rec.endpoint = handle.endpoint
            rec.server_identity = info["server_identity"]
            rec.credential_ref = handle.credential_ref
            rec.capabilities = list(info.get("capabilities") or [])
            rec.log_path = handle.log_path
            rec.pid = handle.pid
            rec.launch_mode = handle.mode
            rec.updated_at = _now()
        log_event(
            "control_server_started",
            f"started control server ({handle.mode}) pid {handle.pid} at {handle.endpoint}",
            MODE=handle.mode,
            SERVER_PID=handle.pid,
            SERVER_IDENTITY=info["server_identity"],
        )
        return client

    def start_claims(self, client: AgentctlClient, endpoint: str, identity: str, credential: bytes) -> None:
        """Renew ownership every unowned period / 4 (AC-EXECUTORS-CONTROL-OWNERSHIP-003.2)."""
        old = self.claim_tasks.pop(endpoint, None)
        if old is not None:
            old.cancel()
        period = float(client.unowned_period_s or 600.0)
        self.claim_tasks[endpoint] = asyncio.get_running_loop().create_task(
            self._claim_loop(endpoint, identity, credential, period / 4), name=f"claims-{endpoint}"
        )

    async def _claim_loop(self, endpoint: str, identity: str, credential: bytes, interval: float) -> None:
        conn: AgentctlClient | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await AgentctlClient.connect(
                            endpoint, credential=credential, installation_id=self.installation_id,
                            expected_identity=identity,
                        )
                    await conn.claim()
                except OwnershipRefused as exc:
                    # Our credential no longer authenticates (another backend adopted it and confirmed),
                    # or another server answers there: nothing left to renew, no retry (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3).
                    log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.reason}", priority=4,
                              REASON=exc.reason)
                    self.release_link(endpoint)
                    return
                except IpcError as exc:
                    if exc.code in (ErrorCode.SUPERSEDED_CREDENTIAL, ErrorCode.SHUTTING_DOWN):
                        # Another backend adopted it, or it is exiting: not ours to renew (AC-EXECUTORS-CONTROL-OWNERSHIP-002.3, AC-EXECUTORS-CONTROL-OWNERSHIP-003.9).
                        log_event("ownership_lost", f"stopped renewing {endpoint}: {exc.code}", priority=4,
                                  REASON=exc.code)
                        if exc.code == ErrorCode.SUPERSEDED_CREDENTIAL:
                            self.release_link(endpoint)  # one that exits is a loss its link handles
                        return
                    log.warning("ownership claim failed: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                except Exception as exc:  # a failed renewal never shortens the period
                    log.warning("ownership claim failed: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                await asyncio.sleep(interval)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    def on_adopted(self, client: AgentctlClient, credential: bytes) -> None:
        # The claim loop starts as soon as the rotation is confirmed, not after re-tracking (AC-EXECUTORS-CONTROL-OWNERSHIP-003.8).
        self.credential = credential
        self.start_claims(client, client.socket_path, client.identity, credential)

    def use(self, client: AgentctlClient | None, adopted: ControlServerRecord | None) -> None:
        """Startup recovery's outcome: the survival server it adopted (``adopted``) or started, if any."""
        self.survival.client = client
        if client is not None:
            client.on_superseded = self.superseded
        if client is not None and adopted is not None:
            rec = adopted
            self.server_identity = rec.server_identity
            self.survival.handle = ControlServerHandle(
                endpoint=rec.endpoint,
                mode=rec.launch_mode,
                credential_ref=rec.credential_ref,
                log_path=rec.log_path,
                pid=rec.pid,
            )
            with self.store.session() as db:
                stored = ClusterIdentity.of(self.config).record(db)
                if stored is not None:
                    stored.capabilities = list(client.capabilities)
                    stored.updated_at = _now()

    def watch(self) -> None:
        """After startup recovery: the survival link watches the server in use, or keeps trying to
        start one if startup could not."""
        client, handle = self.survival.client, self.survival.handle
        if client is not None and handle is not None:
            self.survival.link.attach(self.attached(handle, client))
        elif self.first_failure is not None:
            self.survival.link.start_failed(self.first_failure)  # the backend stays up; its link keeps trying

    async def close(self) -> None:
        """Shutdown: nothing that follows is a loss; claims stop; clients close; a child server stops."""
        await asyncio.gather(self.survival.link.close(), self.passthrough.link.close())
        await asyncio.gather(*(cancel_and_wait(task) for task in self.claim_tasks.values()))

    async def stop_survival_server(self) -> None:
        """``kandev down --agents``: the survival server stops every agent and exits (its unit, if any,
        goes inactive). A server that does not answer is left to its unowned period."""
        client = self.survival.client
        if client is None:
            return
        try:
            await client.ownership_shutdown()
        except IpcError as exc:
            log.warning("kandev down --agents: the control server did not stop its agents: %s", exc)

    async def disconnect(self) -> None:
        for client in (self.survival.client, self.passthrough.client):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
        if self.survival.handle is not None and self.survival.handle.mode == LaunchMode.CHILD:
            await Launcher.terminate(self.survival.handle)
        if self.passthrough.handle is not None:
            await Launcher.terminate(self.passthrough.handle)

    # ------------------------------------------------ control-server losses
    @staticmethod
    def attached(handle: ControlServerHandle, client: AgentctlClient) -> Attached:
        return Attached(handle, client, ServerWatch(handle, lambda: client.closed))

    def release_link(self, endpoint: str) -> None:
        for side in (self.survival, self.passthrough):
            link = side.link
            if link.attached is not None and link.attached.handle.endpoint == endpoint:
                link.release()

    async def server_lost(self, attached: Attached, loss: Loss, *, passthrough: bool) -> list[str]:
        """A control server died under us (its link saw it): forget it, make every session that
        lived on it truthful as startup recovery would with no server left, and remove what we
        wrote for it. Returns the sessions interrupted."""
        handle: ControlServerHandle = attached.handle
        side = self.side(passthrough)
        side.client, side.handle = None, None
        claims = self.claim_tasks.pop(handle.endpoint, None)
        if claims is not None:
            await cancel_and_wait(claims)
        dropped = await self.executions.drop(lambda ex: ex.passthrough == passthrough, "interrupted")
        for ex in dropped:  # their agents died with the server: nobody left to serve
            self.endpoints.close_soon(ex.session_id)
        tracked = [LostAgent(ex.session_id, ex.agent, ex.last_seq) for ex in dropped]
        with self.store.session() as db:
            repaired = repair_lost_server(db, endpoint=handle.endpoint, tracked=tracked, reason=loss.reason,
                                          identity=ClusterIdentity.of(self.config),
                                          now=_now())
        with contextlib.suppress(Exception):
            await attached.client.close()
        self.survival.launcher.remove_files(handle)
        return repaired

    async def first_server(self) -> AgentctlClient | None:
        """Startup recovery's start: a server that cannot be started does not stop the backend."""
        try:
            return await self.start_own_server()
        except Exception as exc:
            self.first_failure = f"start failed: {exc}" if str(exc) else f"start failed: {type(exc).__name__}"
            log_event("control_server_start_failed", f"could not start a control server: {exc}; the backend"
                      " keeps trying (kandev status)", priority=3, REASON=self.first_failure)
            return None

    async def restart_own_server(self) -> Attached:
        """The survival link's restart: a fresh server the way startup starts one (unit, detached or child;
        a fresh credential and control-server record, its own claim loop)."""
        if self.survival.launcher.mode == LaunchMode.UNIT:
            await self.survival.launcher.wait_unit_settled()  # systemd may still be killing the old unit's cgroup
        client = await self.start_own_server()
        client.on_superseded = self.superseded
        self.survival.client = client
        assert self.survival.handle is not None
        return self.attached(self.survival.handle, client)

    async def start_passthrough_server(self) -> Attached:
        """A control server that is always our child, for passthrough sessions (AC-EXECUTORS-SURVIVAL-005.3)."""
        handle, credential = await self.passthrough.launcher.start()
        try:
            client, info = await self.connect(handle, credential)
        except BaseException:
            await Launcher.terminate(handle)
            self.passthrough.launcher.remove_files(handle)
            raise
        client.on_superseded = self.superseded
        self.passthrough.client, self.passthrough.handle = client, handle
        # It dies with us, but it must not reap itself while we live (AC-EXECUTORS-CONTROL-OWNERSHIP-003.1).
        self.start_claims(client, handle.endpoint, info["server_identity"], credential)
        return self.attached(handle, client)

    @staticmethod
    def no_server(link: ControlServerLink) -> IpcError:
        loss = link.last_loss
        why = f" (last loss: {loss.reason})" if loss is not None else ""
        if link.state == LinkState.GAVE_UP:
            return IpcError("control_server_unavailable",
                            f"the {link.name} control server kept dying and the backend gave up restarting it{why};"
                            " fix the cause, then `kandev up` tries again", False)
        return IpcError("control_server_unavailable",
                        f"the {link.name} control server is {link.state.value}{why}; retry shortly", True)

    def retry(self) -> list[str]:
        """``kandev up`` with a backend that runs: try again where it gave up restarting a server."""
        return [side.link.name for side in (self.survival, self.passthrough) if side.link.retry()]

    async def server_for(self, passthrough: bool) -> AgentctlClient:
        """The client a new launch uses; the passthrough server is started when first needed."""
        if passthrough:
            side = self.passthrough
            if side.client is None:
                if side.link.state != LinkState.NONE:  # lost: its link restarts it
                    raise self.no_server(side.link)
                side.link.attach(await self.start_passthrough_server())
            assert side.client is not None
            return side.client
        if self.survival.client is None:
            if self.survival.link.state in (LinkState.LOST, LinkState.RESTARTING, LinkState.GAVE_UP):
                raise self.no_server(self.survival.link)
            raise IpcError(ErrorCode.UNAVAILABLE, "the backend has no control server yet; retry shortly", True)
        return self.survival.client
