"""The single-driver lock: one backend per Kandev home (design.md §5).

``fcntl.flock`` on ``<home>/backend.lock``, opened without following
symlinks and required to be a regular file, taken before anything else and
held for the whole process lifetime (the kernel drops it when we exit, even
on SIGKILL). The holder writes its pid into the file so that a refused second
backend can name it.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


class LockHeld(RuntimeError):
    """Another backend holds the lock; ``holder_pid`` may be None if unreadable."""

    def __init__(self, path: Path, holder_pid: int | None) -> None:
        who = f"pid {holder_pid}" if holder_pid else "another process"
        super().__init__(f"another kandev-backend ({who}) is already running for this home: {path} is locked")
        self.holder_pid = holder_pid


class HomeLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RuntimeError(f"{self.path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockHeld(self.path, _read_pid(fd)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None
