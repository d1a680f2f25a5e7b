"""Bounds on the agents' stderr files (``<home>/logs/agents/<instance id>.stderr.log``).

An agent writes its stderr straight into its file (the descriptor is handed to the process, so
nothing is lost while the control server is busy), which alone would let a chatty agent fill the
disk and leave a file behind for every instance ever started. The control server bounds them:

- **size** (``cap``), about every minute for each of its running instances: a file over
  ``MAX_BYTES`` keeps only its last ``KEEP_BYTES``, after a marker line saying how much was cut.
  This is logrotate's *copytruncate*: the agent keeps appending to the same file, and what it
  writes in the instant between the copy and the truncation may be lost.
- **age** (``prune``), at start and hourly: a file not written for ``MAX_AGE_S`` whose instance
  this server does not run is removed (a file another control server's agent still writes is
  recent, so it stays).

The bounds are fixed constants (like the control server's own log's), not settings. Only regular
files named ``*.stderr.log`` directly in the directory are touched, never a symlink.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

MAX_BYTES = 10 * 1024 * 1024
KEEP_BYTES = 1024 * 1024
MAX_AGE_S = 14 * 24 * 3600
CAP_EVERY_S = 60.0
PRUNE_EVERY_S = 3600.0
SUFFIX = ".stderr.log"


def cap(path: Path, max_bytes: int = MAX_BYTES, keep_bytes: int = KEEP_BYTES) -> int:
    """Cut ``path`` to its last ``keep_bytes`` if it is over ``max_bytes``; the bytes dropped."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0  # gone, or a symlink (ELOOP): not ours to touch
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
            return 0
        tail = os.pread(fd, keep_bytes, st.st_size - keep_bytes)
        newline = tail.find(b"\n")
        if 0 <= newline < len(tail) - 1:
            tail = tail[newline + 1:]  # start on a line boundary
        dropped = st.st_size - len(tail)
        os.ftruncate(fd, 0)
        os.write(fd, f"[kandev: {dropped} earlier bytes of this agent's stderr were cut (the file is kept"
                     f" under {max_bytes} bytes)]\n".encode() + tail)
        return dropped
    finally:
        os.close(fd)


def prune(directory: Path, keep: set[Path], max_age_s: float = MAX_AGE_S, now: float | None = None) -> list[Path]:
    """Remove the stderr files in ``directory`` not written for ``max_age_s`` and not in ``keep``."""
    now = time.time() if now is None else now
    keep = {p.resolve() for p in keep}
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        path = Path(entry.path)
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < max_age_s or path.resolve() in keep:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed
