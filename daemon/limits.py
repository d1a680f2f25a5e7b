"""Process limits both daemons raise at start.

Every supervised agent costs the control server three pipes and every tracked
session costs one stream connection on each side, so the default soft limit on
open files (often 1024) would cap a server at a few hundred agents. Raise the
soft limit to the hard limit the service manager granted; never above it.
"""

from __future__ import annotations

import resource

# One stream connection per instance plus control connections; the open-file limit is the real cap.
MAX_CONNECTIONS = 16384


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
