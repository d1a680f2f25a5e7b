"""Who this backend is in a cluster (Issue 47): ``ClusterIdentity(host)``.

Cluster mode is ``cluster.host`` set with a PostgreSQL ``database.url`` (``daemon.config.settings``
refuses a host name with SQLite at start); without it the backend is a single host, exactly as
before. The identity decides what "this backend's" rows are: in cluster mode the sessions whose
``task_sessions.host`` is this host and the control-server record of this host's name; on a single
host every session and the one record ``id = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, func, select, text, true
from sqlalchemy.orm import Session

from daemon.config.settings import Config
from daemon.store.models import SINGLE_HOST, ControlServerRecord, TaskSession

RECORD_ID_LOCK = 0x6B616E646576  # pg_advisory_xact_lock: one new record's id at a time ("kandev")


@dataclass(frozen=True)
class ClusterIdentity:
    """This backend's host name in the cluster; None: a single host (no cluster)."""

    host: str | None = None

    @classmethod
    def of(cls, config: Config) -> ClusterIdentity:
        """The identity ``config`` gives (``cluster.host``; validated at start to go with PostgreSQL)."""
        return cls(config.cluster.host)

    @property
    def enabled(self) -> bool:
        return self.host is not None

    @property
    def record_key(self) -> str:
        """The ``host`` of this host's control-server record (``SINGLE_HOST`` on a single host)."""
        return self.host if self.host is not None else SINGLE_HOST

    def record(self, db: Session) -> ControlServerRecord | None:
        """This host's control-server record (the one row ``id = 1`` on a single host)."""
        if self.host is None:
            return db.get(ControlServerRecord, 1)
        return db.scalars(select(ControlServerRecord).where(ControlServerRecord.host == self.host)).first()

    def new_record(self, db: Session) -> ControlServerRecord:
        """A new control-server record of this host, added to ``db`` (the caller fills it in): ``id = 1``
        on a single host; the next free id in a cluster, hosts taking one in turn."""
        if self.host is None:
            rec = ControlServerRecord(id=1, host=SINGLE_HOST)
        else:
            if db.get_bind().dialect.name == "postgresql":
                db.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": RECORD_ID_LOCK})
            top = db.scalar(select(func.max(ControlServerRecord.id))) or 1
            rec = ControlServerRecord(id=top + 1, host=self.host)
        db.add(rec)
        return rec

    def own_sessions(self, column: Any = None) -> ColumnElement[bool]:
        """The WHERE clause of this host's sessions: ``task_sessions.host`` (or ``column``, a host column
        of another table joined to the session) is this host in cluster mode; every session otherwise."""
        if self.host is None:
            return true()
        return (TaskSession.host if column is None else column) == self.host

    def owns(self, session_host: str | None) -> bool:
        """Whether this backend drives a session recorded with host ``session_host``."""
        return self.host is None or session_host == self.host

    def new_session_host(self) -> str | None:
        """The host a session this backend creates records: its own in cluster mode, None otherwise."""
        return self.host
