"""A throwaway PostgreSQL server for tests: the store on ``database.url`` against a real server.

``PgCluster.start()`` runs ``initdb`` into a fresh directory under /var/tmp and starts
``postgres`` listening only on a Unix socket in that directory (no TCP), with local ``trust``
authentication: nothing outside this machine's root and the cluster's own user can reach it.
PostgreSQL refuses to run as root, so under root the cluster runs as ``nobody``. Each call of
``new_database()`` creates an empty database and returns its SQLAlchemy URL. ``stop()`` stops
the server and removes the directory. For the fault tests (Issue 47 item 5) ``halt()`` stops the
server process (``pg_ctl stop -m fast``: every connection is ended) and ``resume()`` starts it again
on the same data, and ``terminate(dbname)`` ends every other connection to one database
(``pg_terminate_backend``), as a dropped connection would.

When the server binaries or psycopg are missing the tests that need them are skipped, except
under ``CI`` (set by ``.ci/run``), where that is a set-up failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

ROLE = "kandev"


def server_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin directory (Debian layout), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def require() -> Path:
    """The bin directory, or skip (fail under CI) saying what is missing."""
    missing = []
    bindir = server_bin()
    if bindir is None:
        missing.append("the PostgreSQL server (apt-get install postgresql)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing.append("psycopg (pip install 'psycopg[binary]')")
    if missing:
        message = "PostgreSQL tests need " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    assert bindir is not None
    return bindir


class PgCluster:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="kd-pg-", dir="/var/tmp"))
        self.data = self.dir / "data"
        self._as = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []

    def _run(self, *argv: str, timeout: float = 120) -> None:
        proc = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if proc.returncode != 0:
            log = (self.dir / "server.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.strip()}\n{tail}")

    def start(self) -> PgCluster:
        if self._as:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
        os.chmod(self.dir, 0o700)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", ROLE, "-E", "UTF8",
                  "--no-sync")
        self.resume()
        return self

    def resume(self) -> None:
        """Start the server on its data directory (at ``start()``, and again after ``halt()``)."""
        options = f"-k {self.dir} -c listen_addresses='' -c fsync=off -c max_connections=200"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                  str(self.dir / "server.log"), "-w", "-t", "60", "start")

    def halt(self) -> None:
        """Stop the server process (fast shutdown: open transactions are rolled back, every
        connection is ended); ``resume()`` starts it again."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def terminate(self, dbname: str) -> int:
        """End every connection to ``dbname`` but this one (``pg_terminate_backend``); how many."""
        import psycopg

        with psycopg.connect(host=str(self.dir), user=ROLE, dbname="postgres", autocommit=True) as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                                " WHERE datname = %s AND pid <> pg_backend_pid()", (dbname,)).fetchall()
        return sum(1 for (ended,) in rows if ended)

    def query(self, dbname: str, sql: str, *params: object) -> list[tuple[object, ...]]:
        """Rows of one read on ``dbname`` (a connection of its own, closed after)."""
        import psycopg

        with psycopg.connect(host=str(self.dir), user=ROLE, dbname=dbname, autocommit=True) as conn:
            return list(conn.execute(sql, params).fetchall())

    def new_database(self) -> str:
        import psycopg

        name = f"kd_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host=str(self.dir), user=ROLE, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://{ROLE}@/{name}?host={self.dir}"

    def stop(self) -> None:
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
