"""The single-driver locks: one backend per Kandev home (docs/architecture.md#ownership), and one per store.

``fcntl.flock`` on ``<home>/backend.lock``, opened without following
symlinks and required to be a regular file, taken before anything else and
held for the whole process lifetime (the kernel drops it when we exit, even
on SIGKILL). The holder writes its pid into the file so that a refused second
backend can name it. The store's own lock (``StoreLock``) is taken next, the
same way whichever home names the store, so two homes can never drive one store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from daemon.store.db import engine_options, sqlite_file


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


# A session-level PostgreSQL advisory lock key: the first 8 bytes of sha256("kandev-backend").
PG_LOCK_KEY = int.from_bytes(hashlib.sha256(b"kandev-backend").digest()[:8], "big", signed=True)


def host_lock_key(host: str) -> int:
    """The advisory lock key of cluster host ``host``: the first 8 bytes of sha256("kandev-host:HOST")."""
    return int.from_bytes(hashlib.sha256(f"kandev-host:{host}".encode()).digest()[:8], "big", signed=True)


def _running_hosts(conn: Any) -> list[str]:
    """The cluster hosts recorded as not stopped, when the store has the table."""
    try:
        rows = conn.execute(text("SELECT name FROM cluster_hosts WHERE stopped_at IS NULL ORDER BY name")).all()
    except Exception:  # no such table (a store before migration 0007): no cluster
        return []
    return [r[0] for r in rows]


def _host_holder(conn: Any, host: str) -> tuple[int | None, str | None]:
    """The pid and machine recorded for cluster host ``host`` (None, None if not recorded yet)."""
    try:
        row = conn.execute(text("SELECT pid, machine FROM cluster_hosts WHERE name = :n"), {"n": host}).first()
    except Exception:
        return None, None
    return (None, None) if row is None else (row[0], row[1])


class StoreLocked(RuntimeError):
    """Another backend already drives the store named by ``database.url``."""


class StoreLock:
    """The single-driver rule for the store (AC-EXECUTORS-CONTROL-OWNERSHIP-002.4: the home, "and an external SQLite file if
    one is used"; a PostgreSQL database is the same case), whatever home opens it.

    - Every SQLite file, the home's own ``kandev.db`` included: ``flock`` on ``<file>.lock`` beside
      the file's real path (symlinks resolved; never on the database file itself, whose POSIX locks
      belong to SQLite), with the holder's pid written in it, like the home lock. A backend of
      another home that names this home's ``kandev.db`` in ``database.url`` meets the same lock.
    - PostgreSQL: a session-level advisory lock (``pg_try_advisory_lock``) on a dedicated
      connection kept open for the process lifetime; the server drops it when that connection
      ends, SIGKILL included. Two backends of different homes on one database are refused.
      The server drops it too when it restarts or ends that connection (Issue 47 item 5):
      ``ensure()``, called by the store's upkeep every few seconds and once the server is back
      after an outage, finds the connection gone and takes the lock again on a new one (refused,
      ``StoreLocked``, if another backend took it meanwhile).
    - PostgreSQL in a cluster (``host``, Issue 47): the store is shared, the host name is not. The
      backend takes ``PG_LOCK_KEY`` shared (every host of the cluster does; a single-host backend,
      which takes it exclusively, is refused while any host runs and refuses them while it runs)
      and its host's own key (``host_lock_key``) exclusively: a second backend claiming a live
      host name is refused naming the holder's pid and machine (Issue 47 scenario D).
    - Other engines (and in-memory SQLite) get no extra lock.

    ``connect_args``: the driver's connection arguments (the database password,
    ``daemon.config.database``).
    """

    def __init__(self, url: str, host: str | None = None, connect_args: dict[str, Any] | None = None) -> None:
        self.url = url
        self.host = host
        self.connect_args = connect_args or {}
        self._file_lock: HomeLock | None = None
        self._engine: Any = None
        self._conn: Any = None
        self._postgresql = False  # holds (or is to hold again) a PostgreSQL advisory lock

    def acquire(self) -> None:
        url = make_url(self.url)
        backend = url.get_backend_name()
        if backend == "sqlite":
            db = sqlite_file(url)
            if db is None:
                return
            path = db.absolute().resolve()
            lock = HomeLock(path.with_name(path.name + ".lock"))
            try:
                lock.acquire()
            except LockHeld as exc:
                who = f"pid {exc.holder_pid}" if exc.holder_pid else "another process"
                raise StoreLocked(f"another kandev-backend ({who}) already uses the database {path}:"
                                  f" {lock.path} is locked") from None
            self._file_lock = lock
        elif backend == "postgresql":
            self._lock_postgresql()

    def _lock_postgresql(self) -> None:
        engine = create_engine(self.url, poolclass=NullPool, **engine_options(make_url(self.url), self.connect_args))
        try:
            conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except Exception:
            engine.dispose()
            raise
        try:
            refusal = self._take(conn)
        except Exception:
            conn.close()
            engine.dispose()
            raise
        if refusal is not None:
            conn.close()
            engine.dispose()
            raise StoreLocked(refusal)
        self._engine, self._conn = engine, conn
        self._postgresql = True

    def ensure(self) -> bool:
        """Still holding the PostgreSQL lock? If its connection is gone, take the lock again on a
        new one. True when it had to be taken again; raises when it cannot be (server unreachable,
        or ``StoreLocked``: tried again at the next call). Nothing to do for SQLite (a file lock
        cannot be lost) or before ``acquire``."""
        if not self._postgresql:
            return False
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return False
            except Exception:
                conn, engine, self._conn, self._engine = self._conn, self._engine, None, None
                with contextlib.suppress(Exception):
                    conn.close()
                engine.dispose()
        self._lock_postgresql()
        return True

    def _take(self, conn: Any) -> str | None:
        """Take this backend's advisory locks on ``conn``; the refusal when another backend holds one."""
        def lock(fn: str, key: int) -> bool:
            return bool(conn.execute(text(f"SELECT {fn}(:key)"), {"key": key}).scalar())

        if self.host is None:
            if lock("pg_try_advisory_lock", PG_LOCK_KEY):
                return None
            running = _running_hosts(conn)
            if running:
                return ("another kandev-backend already uses this PostgreSQL database: the hosts of a cluster"
                        f" ({', '.join(running)}) share it; set cluster.host to join them")
            return ("another kandev-backend already uses this PostgreSQL database (it holds the"
                    f" advisory lock {PG_LOCK_KEY}); one database serves one kandev home")
        if not lock("pg_try_advisory_lock_shared", PG_LOCK_KEY):
            return ("another kandev-backend already uses this PostgreSQL database as a single host (it holds"
                    f" the advisory lock {PG_LOCK_KEY}); a cluster's hosts cannot share it while it runs")
        if not lock("pg_try_advisory_lock", host_lock_key(self.host)):
            pid, machine = _host_holder(conn, self.host)
            who = f"pid {pid} on machine {machine}" if pid is not None else "a backend still starting"
            return (f"another kandev-backend ({who}) already runs cluster host {self.host!r} on this database;"
                    " one backend per host name: stop that one, or give this home another cluster.host")
        return None

    def release(self) -> None:
        self._postgresql = False
        if self._file_lock is not None:
            self._file_lock.release()
            self._file_lock = None
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._engine.dispose()
                self._conn = self._engine = None
