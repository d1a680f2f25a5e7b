"""The cluster's hosts (Issue 47, docs/cluster.md): claims, heartbeats and reachability.

Each host is a row of ``cluster_hosts``. A backend in cluster mode claims its name at start
(``HostDirectory.claim``), after it took the name's advisory lock
(``daemon.backend.lifetime.lock.StoreLock``): a second backend claiming a live name meets that lock
and is refused naming the holder's pid and machine, read from this table. A name
recorded by another installation (another home) is refused too (``HostForeign``): its sessions'
agents run under that home's control server.

The claimed host then writes a heartbeat every ``cluster.heartbeat_s`` (``run_heartbeats``) and
records a clean stop (``stop``). A host is ``ready`` while its last heartbeat is younger than
``cluster.host_timeout_s``, ``unreachable`` (since its last heartbeat plus the timeout) once it is
older, and ``stopped`` after a clean stop. Times are the database server's clock
(``database_now``), so hosts whose clocks disagree still agree on who is reachable.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from daemon.backend.cluster.identity import ClusterIdentity
from daemon.config.settings import Config
from daemon.core.version import VERSION
from daemon.store.db import Store
from daemon.store.models import ClusterHost, ExecutorRunning, TaskSession, utcnow
from daemon.store.states import InventoryStatus

log = logging.getLogger("kandev.backend.cluster")

READY = "ready"
UNREACHABLE = "unreachable"
STOPPED = "stopped"


class HostForeign(RuntimeError):
    """The host name was claimed by another installation (another Kandev home)."""

    def __init__(self, host: str, owner: str, machine: str, ours: str) -> None:
        super().__init__(f"cluster host {host!r} belongs to installation {owner} (last run on machine {machine});"
                         f" this home is installation {ours}. Its sessions' agents run under that home's control"
                         " server: give this home another cluster.host")
        self.host, self.owner, self.ours = host, owner, ours


@dataclass(frozen=True)
class Reachability:
    """What this backend knows of one host: ``state`` is ``ready``, ``unreachable`` or ``stopped``;
    ``since`` when it became unreachable or stopped (None while ready)."""

    name: str
    state: str
    since: datetime | None
    last_heartbeat: datetime | None
    version: str | None
    pid: int | None
    machine: str | None

    @property
    def live(self) -> bool:
        return self.state == READY


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when is not None else None


def database_now(db: Session) -> datetime:
    """The database server's clock (aware UTC); this machine's on SQLite (no cluster there)."""
    if db.get_bind().dialect.name == "postgresql":
        value: datetime = db.execute(text("SELECT timezone('utc', now())")).scalar_one()
        return value.replace(tzinfo=UTC)
    return utcnow()


def reachability_of(row: ClusterHost, now: datetime, timeout_s: float) -> Reachability:
    """The state of ``row`` at ``now`` under ``timeout_s`` seconds without a heartbeat."""
    if row.stopped_at is not None:
        state, since = STOPPED, row.stopped_at
    elif now - row.heartbeat_at > timedelta(seconds=timeout_s):
        state, since = UNREACHABLE, row.heartbeat_at + timedelta(seconds=timeout_s)
    else:
        state, since = READY, None
    return Reachability(row.name, state, since, row.heartbeat_at, row.version, row.pid, row.machine)


@dataclass(frozen=True)
class HostCounts:
    """A host's sessions (every one recorded with it) and agents (those believed running)."""

    sessions: int = 0
    agents: int = 0


class HostDirectory:
    """The cluster's hosts as this backend sees them, and this host's own claim and heartbeat."""

    def __init__(self, store: Store, identity: ClusterIdentity, installation_id: str, *, heartbeat_s: float,
                 host_timeout_s: float, version: str, machine: str | None = None,
                 clock: Callable[[Session], datetime] = database_now) -> None:
        self.store = store
        self.identity = identity
        self.installation_id = installation_id
        self.heartbeat_s = heartbeat_s
        self.host_timeout_s = host_timeout_s
        self.version = version
        self.machine = machine if machine is not None else os.uname().nodename
        self.clock = clock
        self.last_beat: datetime | None = None
        self.beat_failures = 0

    # ------------------------------------------------------------ this host

    def claim(self, pid: int | None = None) -> None:
        """Record this backend as its host (cluster mode only; the name's advisory lock is held):
        refuses a name of another installation (``HostForeign``)."""
        host = self.identity.host
        if host is None:
            return
        with self.store.session() as db:
            now = self.clock(db)
            row = db.get(ClusterHost, host, with_for_update=True)
            if row is not None and row.installation_id != self.installation_id:
                raise HostForeign(host, row.installation_id, row.machine, self.installation_id)
            if row is None:
                row = ClusterHost(name=host, installation_id=self.installation_id)
                db.add(row)
            row.pid = os.getpid() if pid is None else pid
            row.machine, row.version = self.machine, self.version
            row.started_at = row.heartbeat_at = now
            row.stopped_at = None
        self.last_beat = now

    def heartbeat(self) -> datetime | None:
        """One heartbeat of this host (a blocking write); returns its time."""
        host = self.identity.host
        if host is None:
            return None
        with self.store.session() as db:
            now = self.clock(db)
            row = db.get(ClusterHost, host)
            if row is None:  # removed by hand meanwhile: claimed again
                row = ClusterHost(name=host, installation_id=self.installation_id, pid=os.getpid(),
                                  machine=self.machine, version=self.version, started_at=now)
                db.add(row)
            row.heartbeat_at = now
            row.stopped_at = None
        self.last_beat = now
        return now

    async def run_heartbeats(self) -> None:
        """Every ``heartbeat_s``: a heartbeat, off the event loop; a failed one (the database is
        unreachable) is logged once per outage and tried again at the next period."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await asyncio.to_thread(self.heartbeat)
            except Exception as exc:
                if self.beat_failures == 0:
                    log.warning("cluster heartbeat failed: %s: %s", type(exc).__name__, exc)
                self.beat_failures += 1
            else:
                if self.beat_failures:
                    log.info("cluster heartbeat written again after %d failures", self.beat_failures)
                self.beat_failures = 0

    def stop(self) -> None:
        """A clean stop: this host is shown ``stopped`` (not unreachable) until it starts again."""
        host = self.identity.host
        if host is None:
            return
        with self.store.session() as db:
            row = db.get(ClusterHost, host)
            if row is not None and row.pid == os.getpid():
                row.stopped_at = self.clock(db)

    # ------------------------------------------------------------ every host

    def reachability(self, name: str) -> Reachability | None:
        """What is known of host ``name``; None for a name no backend ever claimed."""
        with self.store.session() as db:
            row = db.get(ClusterHost, name)
            return None if row is None else reachability_of(row, self.clock(db), self.host_timeout_s)

    def hosts(self) -> list[Reachability]:
        """Every host the cluster has seen, by name."""
        with self.store.session() as db:
            now = self.clock(db)
            rows = db.scalars(select(ClusterHost).order_by(ClusterHost.name)).all()
            return [reachability_of(r, now, self.host_timeout_s) for r in rows]

    def states(self, db: Session) -> dict[str, Reachability]:
        """Every host by name, read in ``db`` (a view's one moment)."""
        now = self.clock(db)
        rows = db.scalars(select(ClusterHost)).all()
        return {r.name: reachability_of(r, now, self.host_timeout_s) for r in rows}

    def summary(self) -> dict[str, Any] | None:
        """``kandev status``'s ``cluster``: this host and the hosts by state; None on a single host. A
        database that cannot be reached is said (``error``), not raised: status must answer."""
        host = self.identity.host
        if host is None:
            return None
        out: dict[str, Any] = {"host": host, "heartbeat_s": self.heartbeat_s, "host_timeout_s": self.host_timeout_s,
                               "last_heartbeat": _iso(self.last_beat), "heartbeat_failures": self.beat_failures}
        try:
            hosts = self.hosts()
        except Exception as exc:
            return {**out, "error": f"the hosts cannot be read: {type(exc).__name__}"}
        out["ready"] = [h.name for h in hosts if h.state == READY]
        out["unreachable"] = [{"name": h.name, "since": _iso(h.since)} for h in hosts if h.state == UNREACHABLE]
        out["stopped"] = [h.name for h in hosts if h.state == STOPPED]
        return out

    @staticmethod
    def counts(db: Session) -> dict[str | None, HostCounts]:
        """Each host's sessions and agents (``None``: sessions of no host)."""
        sessions = dict(db.execute(select(TaskSession.host, func.count()).group_by(TaskSession.host)).all())
        agents = dict(db.execute(
            select(TaskSession.host, func.count()).join(ExecutorRunning, ExecutorRunning.session_id == TaskSession.id)
            .where(ExecutorRunning.status == InventoryStatus.LIVE.value).group_by(TaskSession.host)).all())
        return {h: HostCounts(int(sessions.get(h, 0)), int(agents.get(h, 0))) for h in set(sessions) | set(agents)}


@dataclass(frozen=True)
class Cluster:
    """What a backend knows of its cluster: who it is, and the hosts (``Backend.cluster``). On a single
    host the identity is disabled and the directory claims nothing and writes no heartbeat."""

    identity: ClusterIdentity
    directory: HostDirectory

    @classmethod
    def of(cls, config: Config, store: Store, installation_id: str) -> Cluster:
        identity = ClusterIdentity.of(config)
        c = config.cluster
        return cls(identity, HostDirectory(store, identity, installation_id, heartbeat_s=c.heartbeat_s,
                                           host_timeout_s=c.host_timeout_s, version=VERSION))
