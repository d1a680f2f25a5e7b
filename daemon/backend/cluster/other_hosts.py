"""What a view shows of the sessions of other hosts (Issue 47 item 3, Issue 47 item 4).

A backend knows its own agents (the executions it tracks); another host's agents it knows only
from the shared store: a session of a ready host whose inventory row is live has a live agent
there; a session of an unreachable (or stopped) host has its last known state, and whether its
agent lives is not known, so it is never shown live. ``OtherHosts`` is read in a view's own store
session (one moment with the rows it shows); ``liveness`` gives each session what the views'
``tracked`` map says of this backend's own sessions: absent (no agent), ``None`` (not known) or a
bool (live; re-tracked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from daemon.backend.cluster.membership import READY, Cluster, Reachability
from daemon.store.models import ExecutorRunning, TaskSession
from daemon.store.states import InventoryStatus


@dataclass(frozen=True)
class OtherHosts:
    """The hosts' states and the other hosts' live agents, of one moment."""

    own: str | None = None  # this backend's host; None: a single host (nothing here applies)
    states: dict[str, Reachability] = field(default_factory=dict)
    live: frozenset[str] = frozenset()  # sessions of other hosts whose inventory row is live

    @classmethod
    def read(cls, db: Session, cluster: Cluster | None) -> OtherHosts:
        if cluster is None or not cluster.identity.enabled:
            return cls()
        own = cluster.identity.host
        live = db.scalars(select(ExecutorRunning.session_id)
                          .join(TaskSession, TaskSession.id == ExecutorRunning.session_id)
                          .where(ExecutorRunning.status == InventoryStatus.LIVE, TaskSession.host != own)).all()
        return cls(own, cluster.directory.states(db), frozenset(live))

    def elsewhere(self, host: str | None) -> bool:
        """Whether a session of ``host`` is driven by another host's backend."""
        return self.own is not None and host is not None and host != self.own

    def host_state(self, host: str | None) -> str | None:
        """``ready``, ``unreachable`` or ``stopped`` for a session of ``host``; None on a single host
        (or a session without a host)."""
        if self.own is None or host is None:
            return None
        if host == self.own:
            return READY
        seen = self.states.get(host)
        return seen.state if seen is not None else "unknown"

    def liveness(self, session_id: str, host: str | None, tracked: dict[str, Any]) -> tuple[bool, Any]:
        """Whether the session has an entry in ``tracked`` terms, and that entry: this backend's own
        sessions as ``tracked`` says; another ready host's live agent ``False`` (live, not re-tracked
        here); a session of a host that is not ready ``None`` (not known: never shown live)."""
        if not self.elsewhere(host):
            return session_id in tracked, tracked.get(session_id)
        if self.host_state(host) != READY:
            return True, None
        return (True, False) if session_id in self.live else (False, None)

    def merged(self, tracked: dict[str, Any], sessions: list[tuple[str, str | None]]) -> dict[str, Any]:
        """``tracked`` with the other hosts' sessions among ``sessions`` (id, host) added."""
        if self.own is None:
            return tracked
        out = {sid: v for sid, v in tracked.items()}
        for sid, host in sessions:
            if self.elsewhere(host):
                known, value = self.liveness(sid, host, tracked)
                if known:
                    out[sid] = value
        return out
