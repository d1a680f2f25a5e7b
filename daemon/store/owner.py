"""Which installation a store belongs to: one store serves one Kandev installation.

The store remembers the installation id (``daemon.host.paths.installation_id``, created once per home)
of the backend that first drove it, as the ``installation_id`` row of the ``installation``
key/value table. A backend of another installation is refused at start, before it migrates or
writes anything, with a message naming both ids: it would otherwise take over another
installation's sessions, control-server record and credential leases. A store that has no id yet
(a new one, or one created before stores remembered their owner) is adopted by the first backend
that opens it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, insert, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from daemon.store.db import sqlite_file
from daemon.store.models import ClusterHost, Installation

OWNER_KEY = "installation_id"


class ClusterStoreMismatch(RuntimeError):
    """A single host on a cluster's store, or a cluster host on a single host's store (Issue 47)."""


class ForeignStore(RuntimeError):
    """The store belongs to another installation."""

    def __init__(self, owner: str, ours: str, where: str) -> None:
        super().__init__(
            f"the store {where} belongs to installation {owner}; this home is installation {ours}."
            " One store serves one installation: start the backend with the home that created the store"
            " (its installation-id file), or point database.url at a store of this installation"
        )
        self.owner = owner
        self.ours = ours


def describe_store(url: str) -> str:
    """How messages name the store: an SQLite file by its path; other URLs may hold a password."""
    path = sqlite_file(make_url(url))
    return str(path.absolute()) if path is not None else "named by database.url"


def store_owner(engine: Engine) -> str | None:
    """The installation id the store remembers; None for a store without one (or without tables)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(Installation.__tablename__):
            return None
        return conn.execute(select(Installation.value).where(Installation.key == OWNER_KEY)).scalar()


def cluster_host_names(engine: Engine) -> list[str]:
    """The hosts a cluster's store records (none for a single host's store, or one before 0007)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(ClusterHost.__tablename__):
            return []
        return list(conn.execute(select(ClusterHost.name).order_by(ClusterHost.name)).scalars())


def check_store_owner(url: str, installation_id: str, where: str, *, cluster_host: str | None = None,
                      connect_args: dict[str, Any] | None = None) -> None:
    """Before the store is migrated: refuse a store of another installation (read only).

    A SQLite file that does not exist yet has no owner (and is not created here). In a cluster
    (``cluster_host``, Issue 47) the store is shared by the hosts' installations and each host name
    is checked when claimed (``daemon.backend.cluster.membership``); a store a single host owns is
    refused to a cluster host, and a cluster's store to a single host (``ClusterStoreMismatch``).
    """
    parsed = make_url(url)
    path = sqlite_file(parsed)
    if path is not None and not path.exists():
        return
    engine = create_engine(parsed, poolclass=NullPool, connect_args=connect_args or {})
    try:
        owner = store_owner(engine)
        hosts = cluster_host_names(engine)
    finally:
        engine.dispose()
    if cluster_host is not None:
        if owner is not None:
            raise ClusterStoreMismatch(
                f"the store {where} belongs to the single-host installation {owner}: cluster.host = {cluster_host!r}"
                " needs a database of its own (or remove cluster.host to use this one as a single host)")
        return
    if hosts:
        raise ClusterStoreMismatch(
            f"the store {where} is a cluster's (hosts {', '.join(hosts)}): set cluster.host to join it as a host,"
            " or point database.url at another database")
    if owner is not None and owner != installation_id:
        raise ForeignStore(owner, installation_id, where)


def claim_store(engine: Engine, installation_id: str, where: str) -> bool:
    """After migrations: record ``installation_id`` as the store's owner unless it has one.

    Returns True when this call adopted the store; raises ``ForeignStore`` when another
    installation owns it.
    """
    adopted = False
    try:
        with engine.begin() as conn:
            owner = conn.execute(select(Installation.value).where(Installation.key == OWNER_KEY)).scalar()
            if owner is None:
                conn.execute(insert(Installation).values(key=OWNER_KEY, value=installation_id))
                owner, adopted = installation_id, True
    except IntegrityError:  # another process adopted it in between
        adopted = False
        owner = store_owner(engine)
    if owner != installation_id:
        raise ForeignStore(str(owner), installation_id, where)
    return adopted
