"""Process and socket limits both daemons apply at start.

Every supervised agent costs the control server three pipes and every tracked
session costs one stream connection on each side, so the default soft limit on
open files (often 1024) would cap a server at a few hundred agents. Raise the
soft limit to the hard limit the service manager granted; never above it.

Each daemon's socket then admits at most ``connection_limit()`` connections:
half the open-file limit (up to ``MAX_CONNECTIONS``), so connections alone can
never exhaust the descriptors the daemon needs for its agents, its store and
``accept()`` itself. A peer over the limit gets a typed, retryable
``unavailable``. A connection with no request in flight that sends nothing for
``IDLE_CONNECTION_TIMEOUT_S`` is told ``idle_timeout`` and closed (streams are
never idle; the control server also keeps connections authenticated with the
ownership credential); the receive buffers of all connections together are
capped at ``BUFFER_LIMIT`` bytes (``buffers_full`` past it).
"""

from __future__ import annotations

import resource

# One stream connection per instance plus control connections; the open-file limit is the real cap.
MAX_CONNECTIONS = 16384
MIN_CONNECTIONS = 64

IDLE_CONNECTION_TIMEOUT_S = 10.0
"""Seconds a connection may stay open with no request in flight and nothing sent."""

BUFFER_LIMIT = 32 * 1024 * 1024
"""Receive-buffer bytes all connections of one daemon's socket may hold together (4 whole
8 MiB frames at once; a connection's first 16 KiB are always granted)."""


def raise_open_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_limit() -> int:
    """Connections a daemon's socket admits: half the open-file soft limit, within
    ``MIN_CONNECTIONS``..``MAX_CONNECTIONS``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft // 2))
