"""A throwaway PostgreSQL server for tests: the store on ``database.url`` against a real server.

``PgCluster.start()`` runs ``initdb`` into a fresh directory under /var/tmp and has
pytest-xprocess start ``postgres`` listening only on a Unix socket in that directory (no TCP),
with local ``trust`` authentication: nothing outside this machine's root and the cluster's own
user can reach it. PostgreSQL refuses to run as root, so under root the server runs as
``nobody``. Each call of ``new_database()`` creates an empty database and returns its SQLAlchemy
URL. ``restart()`` stops the server and starts it again (a database restart under running
backends); ``stop()`` stops it and removes the directory. For the fault tests (Issue 47 item 5)
``stop_server()`` and ``start_server()`` stop the server and start it again on the same data, and
``terminate(dbname)`` ends every other connection to one database (``pg_terminate_backend``), as
a dropped connection would. pytest-xprocess's own ``xprocess``
fixture keeps its files in pytest's cache, which the suite runs without
(``-p no:cacheprovider``), so the ``postgres`` fixture gives it this directory instead.

When the server binaries or psycopg are missing the tests that need them are skipped, except
under ``CI`` (set by ``.ci/run``), where that is a set-up failure.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import types
import uuid
from pathlib import Path
from typing import Any

import psutil
import py
import pytest
from xprocess import ProcessStarter

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
    """A throwaway PostgreSQL server whose process pytest-xprocess starts and stops (``start``,
    ``restart``, ``stop``); its data, socket, logs and xprocess's control files live in ``dir``."""

    NAME = "postgres"

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="kd-pg-", dir="/var/tmp"))
        self.data = self.dir / "data"
        self._as = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self._xprocess: Any = None

    def _run(self, *argv: str, timeout: float = 120) -> None:
        proc = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=timeout, cwd=self.dir)
        if proc.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.strip()}\n{self.log_tail()}")

    def log_tail(self) -> str:
        log = self.dir / "xprocess" / self.NAME / "xprocess.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def start(self, config: pytest.Config | None = None) -> PgCluster:
        """``initdb`` once, then the server under pytest-xprocess: its ``postgres`` process is
        xprocess's, listening only on a Unix socket in ``dir``; ready when its log says so.
        ``config``: pytest's (xprocess adds the server's log to failing tests' reports); a script
        (a benchmark) gives none."""
        from xprocess import XProcess

        if self._as:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
        os.chmod(self.dir, 0o700)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", ROLE, "-E", "UTF8",
                  "--no-sync")
        (self.dir / "xprocess").mkdir()
        quiet = types.SimpleNamespace(debug=lambda *args: None)  # its own log is in the server's (log_tail)
        self._xprocess = XProcess(config if config is not None else types.SimpleNamespace(),
                                  py.path.local(self.dir / "xprocess"), log=quiet)
        self._ensure(restart=False)
        return self

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

    def _ensure(self, *, restart: bool) -> None:
        server = [str(self.bindir / "postgres"), "-D", str(self.data), "-k", str(self.dir), "-c", "listen_addresses=",
                  "-c", "fsync=off", "-c", "max_connections=200"]
        argv = [*(("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups") if self._as else ()), *server]

        class Starter(ProcessStarter):
            pattern = "database system is ready to accept connections"
            args = argv
            timeout = 60
            terminate_on_interrupt = True

        self._xprocess.ensure(self.NAME, Starter, restart=restart)

    @property
    def pid(self) -> int | None:
        """The server's (postmaster's) pid."""
        return self._xprocess.getinfo(self.NAME).pid if self._xprocess is not None else None

    def restart(self, *, stopped_for: float = 0.0) -> None:
        """Stop the server (fast: its clients are disconnected) and start it again, as an operator's
        restart does; ``stopped_for``: seconds it stays down in between (Issue 47 scenario C)."""
        self.stop_server()
        if stopped_for:
            threading.Event().wait(stopped_for)  # the outage itself, not a wait for a condition
        self.start_server()

    def start_server(self) -> None:
        """Start the server again after ``stop_server`` (its data kept)."""
        self._ensure(restart=True)

    def stop_server(self) -> None:
        """Stop the server (fast shutdown: its clients are disconnected); its data stays."""
        info = self._xprocess.getinfo(self.NAME) if self._xprocess is not None else None
        if info is None or not info.isrunning():
            return
        os.kill(info.pid, signal.SIGINT)  # fast shutdown; xprocess's own SIGTERM would wait for clients
        try:
            psutil.Process(info.pid).wait(30)
        except psutil.NoSuchProcess:
            pass
        except psutil.TimeoutExpired:
            info.terminate(timeout=10)

    def new_database(self, owner: str = ROLE) -> str:
        """An empty database of ``owner`` (a role of ``password_role``, or the trusted ``kandev``)."""
        import psycopg

        name = f"kd_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host=str(self.dir), user=ROLE, dbname="postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" OWNER "{owner}"')
        return f"postgresql+psycopg://{owner}@/{name}?host={self.dir}"

    def password_role(self, name: str, password: str) -> None:
        """A role that must give ``password`` (scram-sha-256) to connect; every other role keeps
        ``trust``. The server reloads its authentication rules (no restart)."""
        import psycopg

        hba = self.data / "pg_hba.conf"
        hba.write_text(f"local all {name} scram-sha-256\n" + hba.read_text())
        with psycopg.connect(host=str(self.dir), user=ROLE, dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE ROLE \"{name}\" LOGIN PASSWORD '{password}'")
            conn.execute("SELECT pg_reload_conf()")

    def stop(self) -> None:
        try:
            self.stop_server()
        finally:
            if self._xprocess is not None:  # its log is no longer added to failing tests' reports
                self._xprocess.config.__dict__.get("_extlogfiles", {}).pop(self.NAME, None)
                for resource in self._xprocess.resources:
                    resource.release()
            shutil.rmtree(self.dir, ignore_errors=True)
