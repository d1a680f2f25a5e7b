"""The agents' stderr files (``<home>/logs/agents/<instance id>.stderr.log``), bounded.

An agent's stderr is a pipe to the control server, drained into its file by one thread for all
agents (``stderr_drain``). The files are bounded:

- **size**: before a write would take the file over ``MAX_BYTES``, the drain cuts it to its last
  ``KEEP_BYTES`` after a marker line saying how much was cut (``cut``), so the file never holds
  more than ``MAX_BYTES`` (plus the marker) at any moment. ``cap`` does the same from outside,
  about every minute, for files an agent still writes directly (one started by a control server
  older than 0.3.0, taken over by a reload).
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


def from_a_line(tail: bytes) -> bytes:
    """``tail`` from its first line boundary (all of it if it holds none)."""
    newline = tail.find(b"\n")
    return tail[newline + 1:] if 0 <= newline < len(tail) - 1 else tail


MARKER = b"[kandev: "


def marker_length(fd: int) -> int:
    """The length of the marker line an earlier cut left at the file's start (0: none)."""
    head = os.pread(fd, 256, 0)
    end = head.find(b"]\n")
    return end + 2 if head.startswith(MARKER) and end >= 0 else 0


def marker(cut_bytes: int, max_bytes: int) -> bytes:
    """The line a cut leaves at the file's start."""
    return MARKER + (f"{cut_bytes} earlier bytes of this agent's stderr were cut (the file is kept"
                     f" under {max_bytes} bytes)]\n").encode()


def cut(fd: int, size: int, max_bytes: int, keep_bytes: int) -> int:
    """Cut the file open at ``fd`` (``size`` bytes, opened O_APPEND) to its last ``keep_bytes``."""
    tail = from_a_line(os.pread(fd, keep_bytes, max(0, size - keep_bytes)))
    dropped = size - len(tail) - marker_length(fd)  # the agent's bytes, not an earlier cut's marker
    os.ftruncate(fd, 0)
    os.write(fd, marker(dropped, max_bytes) + tail)
    return dropped


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
        return cut(fd, st.st_size, max_bytes, keep_bytes)
    finally:
        os.close(fd)


def tail(path: Path, limit: int) -> str:
    """The last ``limit`` bytes of an agent's stderr file, as text ("" if it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


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
