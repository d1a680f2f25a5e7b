"""Who is on the other end of a Unix socket, and may they talk to us.

``peer_credentials`` reads ``SO_PEERCRED`` (the pid, uid and gid the kernel
recorded when the peer connected); ``peer_admitted`` decides admission from
an allowed uid set and an allowed gid set, the latter also matched against
the peer process's supplementary groups (``/proc/<pid>/status``).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket | Any) -> PeerCredentials:
    """The kernel-recorded credentials of the peer of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def _status_fields(pid: int) -> dict[str, list[int]] | None:
    """``Uid:``, ``Gid:`` and ``Groups:`` of /proc/<pid>/status, or None if unreadable."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    fields: dict[str, list[int]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("Uid", "Gid", "Groups"):
            try:
                fields[key] = [int(v) for v in value.split()]
            except ValueError:
                return None
    return fields


def supplementary_groups(creds: PeerCredentials) -> frozenset[int]:
    """The peer process's supplementary groups, read from /proc.

    Empty when the process is gone or when /proc shows a process whose
    effective uid/gid differ from the recorded credentials (the pid was
    reused, or the peer changed identity since it connected): never admit on
    the strength of another process's groups.
    """
    fields = _status_fields(creds.pid)
    if not fields:
        return frozenset()
    uids, gids = fields.get("Uid", []), fields.get("Gid", [])
    if len(uids) < 2 or len(gids) < 2 or uids[1] != creds.uid or gids[1] != creds.gid:
        return frozenset()
    return frozenset(fields.get("Groups", []))


def peer_admitted(
    creds: PeerCredentials, allowed_uids: Collection[int], allowed_gids: Collection[int]
) -> bool:
    """Admit a peer whose uid is allowed, whose gid is allowed, or (when any
    gid is allowed) one of whose supplementary groups is allowed."""
    if creds.uid in allowed_uids:
        return True
    if not allowed_gids:
        return False
    if creds.gid in allowed_gids:
        return True
    return not supplementary_groups(creds).isdisjoint(allowed_gids)
