"""The agents' stderr files (``<home>/logs/agents/<instance id>.stderr.log``), bounded.

An agent's stderr is a pipe to the control server (``StderrSink``), never a file of the host: no
descriptor an agent could reopen by path (``/proc/<parent>/fd/2``) names the log. One thread per
agent reads the pipe and writes the file itself, so a flood there costs that thread only, never
the event loop that serves the other agents, and the file is bounded while it is written:

- **size**: before a write would take the file over ``MAX_BYTES``, the file is cut to its last
  ``KEEP_BYTES`` after a marker line saying how much was cut. The sink is the file's only writer,
  so nothing is lost between copy and cut, and the file never holds more than ``MAX_BYTES`` (plus
  the marker) at any moment. ``cap`` does the same from outside, about every minute, for files an
  agent still writes directly (one started by a control server older than this one, taken over by
  a reload).
- **age** (``prune``), at start and hourly: a file not written for ``MAX_AGE_S`` whose instance
  this server does not run is removed (a file another control server's agent still writes is
  recent, so it stays).

A re-exec of the control server hands the pipe's read end over (``pause``, then the new image
starts a sink on it): what the agent writes meanwhile waits in the pipe.

The bounds are fixed constants (like the control server's own log's), not settings. Only regular
files named ``*.stderr.log`` directly in the directory are touched, never a symlink.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import stat
import threading
import time
from pathlib import Path

log = logging.getLogger("kandev.agentctl.agent_logs")

MAX_BYTES = 10 * 1024 * 1024
KEEP_BYTES = 1024 * 1024
MAX_AGE_S = 14 * 24 * 3600
CAP_EVERY_S = 60.0
PRUNE_EVERY_S = 3600.0
SUFFIX = ".stderr.log"
READ_CHUNK = 64 * 1024


def _cut(fd: int, size: int, max_bytes: int, keep_bytes: int) -> int:
    """Cut the file open at ``fd`` (``size`` bytes, opened O_APPEND) to its last ``keep_bytes``."""
    tail = os.pread(fd, keep_bytes, max(0, size - keep_bytes))
    newline = tail.find(b"\n")
    if 0 <= newline < len(tail) - 1:
        tail = tail[newline + 1:]  # start on a line boundary
    dropped = size - len(tail)
    os.ftruncate(fd, 0)
    os.write(fd, f"[kandev: {dropped} earlier bytes of this agent's stderr were cut (the file is kept"
                 f" under {max_bytes} bytes)]\n".encode() + tail)
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
        return _cut(fd, st.st_size, max_bytes, keep_bytes)
    finally:
        os.close(fd)


class StderrSink:
    """Drains one agent's stderr pipe into its file, bounded while written (module docstring).

    ``start`` runs the drain in its own thread; it ends at the pipe's end of file (the agent and
    everything it started closed their stderr), then closes the pipe. ``pause`` stops the thread
    and leaves the pipe open (a re-exec hands it over); ``close`` stops it and closes the pipe.
    ``drained`` waits (blocking) until end of file or ``timeout``."""

    def __init__(self, read_fd: int, path: Path, *, max_bytes: int = MAX_BYTES, keep_bytes: int = KEEP_BYTES,
                 name: str = "") -> None:
        self.read_fd = read_fd
        self.path = path
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.cut_bytes = 0  # total dropped by cuts
        # What wakes the drain's poll for pause and close: an eventfd, one descriptor where a pipe
        # took two (a control server holds one sink per agent, so this is per agent).
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._stop = False
        self._eof = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stderr.{name}", daemon=True)

    def start(self) -> StderrSink:
        self._thread.start()
        return self

    def _open(self) -> tuple[int, int]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        return fd, os.fstat(fd).st_size

    def _run(self) -> None:
        out = -1
        try:
            out, size = self._open()
            poller = select.poll()
            poller.register(self.read_fd, select.POLLIN)
            poller.register(self._wake, select.POLLIN)
            while not self._stop:
                ready = {fd for fd, _ in poller.poll()}
                if self._stop or self._wake in ready:
                    return
                data = os.read(self.read_fd, READ_CHUNK)
                if not data:
                    self._eof.set()
                    return
                if size + len(data) > self.max_bytes:
                    if len(data) >= self.keep_bytes:  # the new bytes alone fill what is kept
                        self.cut_bytes += size + len(data) - self.keep_bytes
                        os.ftruncate(out, 0)
                        data = f"[kandev: {self.cut_bytes} earlier bytes of this agent's stderr were cut (the file"\
                               f" is kept under {self.max_bytes} bytes)]\n".encode() + data[-self.keep_bytes:]
                        size = 0
                    else:
                        self.cut_bytes += _cut(out, size, self.max_bytes, self.keep_bytes - len(data))
                        size = os.fstat(out).st_size
                try:
                    os.write(out, data)
                    size += len(data)
                except OSError as exc:  # a full disk: this chunk is lost, never the server
                    log.warning("agent stderr %s: %s (a chunk of %d bytes was dropped)", self.path, exc, len(data))
                    size = os.fstat(out).st_size
        except OSError as exc:
            log.warning("agent stderr %s: %s; the rest of this agent's stderr is discarded", self.path, exc)
            self._discard()
        finally:
            if out >= 0:
                os.close(out)
            if self._eof.is_set() or not self._stop:
                self._close_pipe()  # end of file or an error: the pipe is done with

    def _discard(self) -> None:
        """Read and drop until end of file (so the agent never blocks on a stderr nobody reads)."""
        try:
            while not self._stop and os.read(self.read_fd, READ_CHUNK):
                pass
        except OSError:
            pass
        self._eof.set()

    def _close_pipe(self) -> None:
        if self.read_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.read_fd = -1

    def _halt(self) -> None:
        if self._wake < 0:
            return
        self._stop = True
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake, 1)
        if self._thread.is_alive():
            self._thread.join()
        with contextlib.suppress(OSError):
            os.close(self._wake)
        self._wake = -1

    def pause(self) -> int | None:
        """Stop draining, keep the pipe open; its read end (None: the pipe reached its end)."""
        self._halt()
        return None if self._eof.is_set() or self.read_fd < 0 else self.read_fd

    def close(self) -> None:
        self._halt()
        self._close_pipe()

    def drained(self, timeout: float) -> bool:
        """Whether the pipe reached its end within ``timeout`` s (blocking)."""
        return self._eof.wait(timeout)

    @property
    def eof(self) -> bool:
        return self._eof.is_set()


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
