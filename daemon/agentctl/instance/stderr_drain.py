"""One thread drains every agent's stderr pipe into its bounded file (``agent_logs``).

An agent's stderr is a pipe to the control server, never a file of the host: no descriptor an
agent could reopen by path (``/proc/<parent>/fd/2``) names its log. ``StderrSink`` is one agent's
pipe and file; ``StderrDrain`` is the single thread that serves all of them. It waits on every
registered pipe at once (epoll) and, for each pipe with data, reads one chunk and appends it to
that agent's file. So:

- a flood on one agent's stderr costs the drain thread, never the event loop that serves the
  agents' conversations, and takes one chunk per round like every other agent's stderr;
- a control server with 1,000 agents runs one drain thread, not 1,000, and holds a stderr file
  open only while it is being written: at most ``OPEN_FILES_MAX`` of them, the least recently
  written closed first (reopened by name, ``O_NOFOLLOW``, when that agent writes again);
- the file stays bounded while it is written: before a write would take it over ``MAX_BYTES``,
  it is cut to its last ``KEEP_BYTES`` after a marker line saying how much was cut. The sink is
  the file's only writer, so nothing is lost between copy and cut.

A file that cannot be opened or written (a full disk, a symlink planted in its place) costs that
chunk, logged; the pipe is still drained, so the agent never blocks on its stderr. A re-exec of
the control server hands the pipe's read end over (``pause``, then the new image starts a sink on
it): what the agent writes meanwhile waits in the pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections import OrderedDict
from pathlib import Path

from daemon.agentctl.instance.logs import KEEP_BYTES, MAX_BYTES, cut, from_a_line, marker, marker_length

log = logging.getLogger("kandev.agentctl.agent_logs")

READ_CHUNK = 64 * 1024
OPEN_FILES_MAX = 32
"""Stderr files the drain keeps open between writes (the rest are reopened when written)."""


class StderrSink:
    """One agent's stderr pipe and its file, drained by the shared ``StderrDrain``.

    ``start`` registers the pipe; it is read until its end of file (the agent and everything it
    started closed their stderr), then closed. ``pause`` unregisters it and leaves it open (a
    re-exec hands it over); ``close`` unregisters and closes it. ``drained`` waits (blocking)
    until end of file or ``timeout``."""

    def __init__(self, read_fd: int, path: Path, *, max_bytes: int = MAX_BYTES, keep_bytes: int = KEEP_BYTES,
                 drain: StderrDrain | None = None) -> None:
        self.read_fd = read_fd
        self.path = path
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.cut_bytes = 0  # total dropped by cuts
        self._drain = drain if drain is not None else StderrDrain.shared()
        self._eof = threading.Event()
        # The drain's, under its lock: the file while open (-1: closed), its size, and the bytes
        # lost since the last write that worked (a full disk: warned about once, not per chunk).
        self.out = -1
        self.size = 0
        self.dropped = 0

    def start(self) -> StderrSink:
        self._drain.add(self)
        return self

    def pause(self) -> int | None:
        """Stop draining, keep the pipe open; its read end (None: the pipe reached its end)."""
        self._drain.remove(self)
        return None if self._eof.is_set() or self.read_fd < 0 else self.read_fd

    def close(self) -> None:
        self._drain.remove(self)
        self.close_pipe()

    def drained(self, timeout: float) -> bool:
        """Whether the pipe reached its end within ``timeout`` s (blocking)."""
        return self._eof.wait(timeout)

    @property
    def eof(self) -> bool:
        return self._eof.is_set()

    def close_pipe(self) -> None:
        if self.read_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.read_fd)
            self.read_fd = -1

    # -- called by the drain thread, under its lock ----------------------------------------------

    def at_end(self) -> None:
        self._eof.set()

    def open_file(self) -> None:
        self.out = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.size = os.fstat(self.out).st_size

    def close_file(self) -> None:
        if self.out >= 0:
            with contextlib.suppress(OSError):
                os.close(self.out)
            self.out = -1

    def write(self, data: bytes) -> None:
        """Append ``data`` to the open file, cutting it first if it would go over ``max_bytes``."""
        if self.size + len(data) > self.max_bytes:
            if len(data) >= self.keep_bytes:  # the new bytes alone fill what is kept
                tail = from_a_line(data[-self.keep_bytes:])
                self.cut_bytes += self.size - marker_length(self.out) + len(data) - len(tail)
                os.ftruncate(self.out, 0)
                data = marker(self.cut_bytes, self.max_bytes) + tail
                self.size = 0
            else:
                self.cut_bytes += cut(self.out, self.size, self.max_bytes, self.keep_bytes - len(data))
                self.size = os.fstat(self.out).st_size
        try:
            os.write(self.out, data)
            self.size += len(data)
        except OSError:
            self.size = os.fstat(self.out).st_size
            raise


class StderrDrain:
    """The thread that reads every registered stderr pipe and writes each agent's file."""

    _shared: StderrDrain | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> StderrDrain:
        """The process's drain (started on first use; it ends with the process or its re-exec)."""
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    def __init__(self, open_files_max: int = OPEN_FILES_MAX) -> None:
        self.open_files_max = open_files_max
        self._lock = threading.Lock()  # held while a sink is served, added or removed
        self._sinks: dict[int, StderrSink] = {}  # by the pipe's read end
        self._open: OrderedDict[StderrSink, None] = OrderedDict()  # files open, least recently written first
        self._epoll = select.epoll()
        self._thread = threading.Thread(target=self._run, name="stderr-drain", daemon=True)
        self._thread.start()

    def add(self, sink: StderrSink) -> None:
        with self._lock:
            if sink.read_fd < 0 or sink.read_fd in self._sinks:
                return
            # Non-blocking: a readiness the wait reported for a pipe closed since, whose number a
            # new agent's pipe took, must never block the thread (and its lock) on the new one.
            os.set_blocking(sink.read_fd, False)
            self._sinks[sink.read_fd] = sink
            # Registering a pipe that has data wakes the thread's wait (epoll), so no wake-up of its own.
            self._epoll.register(sink.read_fd, select.EPOLLIN)

    def remove(self, sink: StderrSink) -> None:
        """Stop serving ``sink``; once this returns the thread no longer touches its pipe or file."""
        with self._lock:
            self._forget(sink)

    def open_files(self) -> int:
        with self._lock:
            return len(self._open)

    def _forget(self, sink: StderrSink) -> None:
        if self._sinks.get(sink.read_fd) is sink:
            del self._sinks[sink.read_fd]
            with contextlib.suppress(OSError):
                self._epoll.unregister(sink.read_fd)
        self._open.pop(sink, None)
        sink.close_file()

    def _run(self) -> None:
        while True:
            try:
                ready = self._epoll.poll()
            except InterruptedError:
                continue
            for fd, _events in ready:
                with self._lock:
                    sink = self._sinks.get(fd)  # None: removed since the wait returned
                    if sink is None:
                        continue
                    try:
                        self._serve(sink)
                    except Exception:  # a bug must not stop the other agents' stderr being drained
                        log.exception("agent stderr %s: draining failed", sink.path)

    def _serve(self, sink: StderrSink) -> None:
        try:
            data = os.read(sink.read_fd, READ_CHUNK)
        except BlockingIOError:  # nothing after all (see ``add``)
            return
        except OSError as exc:
            log.warning("agent stderr %s: %s; the rest of this agent's stderr is discarded", sink.path, exc)
            data = b""
        if not data:  # end of file (or a pipe that cannot be read): done with it
            self._forget(sink)
            sink.close_pipe()
            sink.at_end()
            return
        self._append(sink, data)

    def note(self, sink: StderrSink, line: str) -> None:
        """One line of kandev's own (``kandev: ...``, e.g. a request its egress proxy refused) in
        the agent's file, between two of the agent's chunks, while the sink is served."""
        with self._lock:
            if self._sinks.get(sink.read_fd) is sink:
                self._append(sink, line.encode("utf-8", "replace"))

    def _append(self, sink: StderrSink, data: bytes) -> None:
        """Write ``data`` to the sink's file, opening it (and closing the least recent) as needed."""
        try:
            if sink.out < 0:
                sink.open_file()
                self._open[sink] = None
                if len(self._open) > self.open_files_max:
                    oldest, _ = self._open.popitem(last=False)
                    oldest.close_file()
            else:
                self._open.move_to_end(sink)
            sink.write(data)
        except OSError as exc:  # a full disk or a symlink in the file's place: this chunk is lost, never the server
            if not sink.dropped:
                log.warning("agent stderr %s: %s; its chunks are dropped until one can be written", sink.path, exc)
            sink.dropped += len(data)
            self._open.pop(sink, None)
            sink.close_file()
            return
        if sink.dropped:
            log.warning("agent stderr %s: written again; %d bytes were dropped", sink.path, sink.dropped)
            sink.dropped = 0


def note_line(sink: StderrSink | None, line: str) -> None:
    """A line of kandev's own among an agent's stderr (what ``kandev logs`` shows); nothing without a
    sink (an agent of an older image writing its file itself)."""
    if sink is not None:
        StderrDrain.shared().note(sink, line if line.endswith("\n") else line + "\n")
