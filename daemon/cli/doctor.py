"""``kandev doctor``: what is wrong with this installation, and how to fix it.

Works without a running backend. Every check is a ``daemon.config.platform.Check``
(name, ok, detail, hint) and the result is the list of them, in this order:

- ``config``: which configuration the checks read (the running backend's, asked over its socket,
  unless ``--config`` names a file or no backend answers) and, for a file, that it loads and
  validates; ``agents`` and one check per refused key file (``daemon.cli.doctor_config``).
- ``platform.*``: every condition of the platform check (``daemon.config.platform.run_checks``). When
  systemd runs ``kandev-backend.service``, they are evaluated as that unit sees the host (its
  environment, its cgroup, its user), not as this shell does.
- ``unit.kandev-backend.service``, ``unit.kandev-agentctl.service``: load and active state (only
  where systemd is the service manager).
- ``home``, ``run_dir``, ``secrets_dir``, ``backend_socket``, ``agentctl_sockets``: ownership
  and modes of the Kandev home, and whether this user can reach the CLI socket (and the backend
  behind it).
- ``control_server``: when the backend answered, the state of its control server(s): running, or
  lost/restarting after a crash, or given up after too many crashes (with the last reason); and
  whether it runs the installed version (a reload runs it in place) or waits to be replaced.
- ``store``: the database opens read-only and its alembic revision is known.
- ``store_space``: whether the store (and the home) has room: what the running backend found at its
  last write (out of space, with the path and free bytes), else the free bytes on the home's
  filesystem; and how big the store is.
- ``node``, ``npm``: present on the PATH the backend uses (npm-based agents need them).
- ``sandbox``: whether agents are sandboxed (``agents.sandbox``) and, if they cannot be, why: as the
  running control server reports it through the backend, else probed by this command;
  ``network``: the network mode and whether agents get network namespaces of their own
  (``daemon.cli.doctor_sandbox``).
- ``agent_memory``: whether agents' memory is bounded, and why not (``daemon.cli.doctor_memory``).

Each probe of the host is a field of ``DoctorProbes`` so tests inject them.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from daemon.api.ops import LinkObserved, LinkState
from daemon.cli import doctor_memory
from daemon.cli.config_read import backend_config
from daemon.cli.doctor_config import agent_checks, configuration, database_url
from daemon.cli.doctor_sandbox import sandbox_checks
from daemon.config import platform
from daemon.config.platform import AGENTCTL_UNIT, Check, Probes
from daemon.config.settings import Config
from daemon.config.view import hidden
from daemon.host.paths import SERVICE_GROUP, Paths

BACKEND_UNIT = "kandev-backend.service"
LOW_SPACE_BYTES = 16 * 1024 * 1024
"""Free bytes on the home's filesystem below which ``store_space`` fails."""
UNITS = (BACKEND_UNIT, AGENTCTL_UNIT)
# PATH of a systemd system service (systemd's default; our units set none)
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
UNIT_PROPS = ("LoadState", "ActiveState", "SubState", "UnitFileState", "Result", "MainPID", "User")
PROBE_TIMEOUT = 5.0


def _systemctl_show(unit: str, props: Sequence[str]) -> dict[str, str] | None:
    try:
        done = subprocess.run(
            ["systemctl", "show", "-p", ",".join(props), unit],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PROBE_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def _backend_status(socket: Path) -> dict[str, Any] | None:
    from daemon.api.version import VERSION as API_VERSION
    from ipc.client import SyncClient
    from ipc.errors import IpcError

    try:
        with SyncClient(str(socket), protocol_major=API_VERSION[0], timeout=2.0) as client:
            status: dict[str, Any] = client.call("status", {}, timeout=3.0)
            return status
    except (IpcError, OSError):
        return None


def _version(exe: str) -> str | None:
    try:
        done = subprocess.run([exe, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _service_gid() -> int | None:
    try:
        return grp.getgrnam(SERVICE_GROUP).gr_gid
    except KeyError:
        return None


def _user_ids(name: str) -> tuple[int, int] | None:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


@dataclass(frozen=True)
class DoctorProbes:
    """How the host is observed; replace any field in tests."""

    platform: Probes = field(default_factory=Probes)
    systemctl_show: Callable[[str, Sequence[str]], dict[str, str] | None] = _systemctl_show
    backend_status: Callable[[Path], dict[str, Any] | None] = _backend_status
    backend_config: Callable[[Path], dict[str, Any] | None] = backend_config
    which: Callable[[str, str | None], str | None] = lambda name, path: shutil.which(name, path=path)
    version: Callable[[str], str | None] = _version
    euid: Callable[[], int] = os.geteuid
    groups: Callable[[], list[int]] = lambda: [os.getegid(), *os.getgroups()]
    service_gid: Callable[[], int | None] = _service_gid
    user_ids: Callable[[str], tuple[int, int] | None] = _user_ids
    head_revision: Callable[[], str | None] = lambda: _head_revision()
    sandbox_probe: Callable[[Mapping[str, str]], Any] = lambda env: _sandbox_probe(env)
    memory_controller: Callable[[], tuple[str | None, str]] = lambda: doctor_memory.host_controller()


def _sandbox_probe(env: Mapping[str, str]) -> Any:
    from daemon.agentctl.sandbox import probe

    return probe.probe(env)


def _head_revision() -> str | None:
    try:
        from daemon.store.db import head_revision

        return head_revision()  # alembic's head, read without importing alembic (test_store_head.py)
    except Exception:
        return None


@dataclass
class _Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str, hint: str | None = None) -> None:
        self.checks.append(Check(name, ok, detail, None if ok else hint))


# ---------------------------------------------------------------- the checks


def _units(r: _Report, probes: DoctorProbes) -> dict[str, dict[str, str]]:
    """Unit states (systemd only); returns them by unit name."""
    if not probes.platform.systemd_booted():
        r.add("unit.systemd", True, "systemd is not the service manager here: units not checked "
              "(run the backend with `kandev up`)")
        return {}
    states: dict[str, dict[str, str]] = {}
    for unit in UNITS:
        props = probes.systemctl_show(unit, UNIT_PROPS)
        if props is None:
            r.add(f"unit.{unit}", False, f"systemctl show {unit} failed",
                  "is systemd reachable? (systemctl status)")
            continue
        states[unit] = props
    backend = states.get(BACKEND_UNIT)
    if backend is not None:
        load, active = backend.get("LoadState", "?"), backend.get("ActiveState", "?")
        summary = (f"{BACKEND_UNIT}: {load}, {active} ({backend.get('SubState', '?')}), "
                   f"{backend.get('UnitFileState') or 'no unit file state'}, result {backend.get('Result', '?')}")
        if load != "loaded":
            r.add(f"unit.{BACKEND_UNIT}", True, f"{BACKEND_UNIT} is not installed ({load}): the backend "
                  "runs without a service manager (`kandev up`)")
        elif active == "active":
            r.add(f"unit.{BACKEND_UNIT}", True, summary + f", main pid {backend.get('MainPID', '?')}")
        elif active == "failed":
            r.add(f"unit.{BACKEND_UNIT}", False, summary,
                  f"see `journalctl -u {BACKEND_UNIT} -b`, fix the cause, then `systemctl restart {BACKEND_UNIT}`")
        else:
            r.add(f"unit.{BACKEND_UNIT}", False, summary, f"systemctl enable --now {BACKEND_UNIT}")
    ctl = states.get(AGENTCTL_UNIT)
    if ctl is not None:
        load, active = ctl.get("LoadState", "?"), ctl.get("ActiveState", "?")
        summary = f"{AGENTCTL_UNIT}: {load}, {active} ({ctl.get('SubState', '?')}), result {ctl.get('Result', '?')}"
        backend_loaded = backend is not None and backend.get("LoadState") == "loaded"
        if load != "loaded":
            r.add(f"unit.{AGENTCTL_UNIT}", not backend_loaded, summary,
                  f"install {AGENTCTL_UNIT} next to {BACKEND_UNIT}, then `systemctl daemon-reload`")
        elif active == "failed":
            r.add(f"unit.{AGENTCTL_UNIT}", False, summary,
                  f"see `journalctl -u {AGENTCTL_UNIT} -b`; `systemctl reset-failed {AGENTCTL_UNIT}`, then "
                  f"`systemctl restart {BACKEND_UNIT}` (only the backend starts it)")
        else:
            note = "" if active == "active" else " (the backend starts it when agent survival is on)"
            r.add(f"unit.{AGENTCTL_UNIT}", True, summary + note)
    return states


def _platform(r: _Report, config: Config | None, env: Mapping[str, str], probes: DoctorProbes,
              states: dict[str, dict[str, str]]) -> str | None:
    """The platform check's conditions; returns the PATH of the backend's context."""
    cfg = config or Config()
    backend = states.get(BACKEND_UNIT, {})
    plat_env: Mapping[str, str] = env
    plat_probes = probes.platform
    path, caveat = env.get("PATH"), ""
    if backend.get("LoadState") == "loaded":
        # Evaluate as the backend unit sees the host: under systemd, in its own cgroup, as its user.
        ids = probes.user_ids(backend.get("User") or "root")
        unit_uid = ids[0] if ids else 0
        plat_env = {**env, "INVOCATION_ID": env.get("INVOCATION_ID", "kandev-doctor")}
        plat_probes = replace(
            plat_probes,
            euid=lambda: unit_uid,
            cgroup=lambda: f"0::/system.slice/{BACKEND_UNIT}\n",
        )
        path = SERVICE_PATH
        me = probes.euid()
        if me not in (0, unit_uid):
            caveat = f" (as seen by uid {me}: run `sudo kandev doctor` for the polkit rule check)"
    for c in platform.run_checks(cfg, env=plat_env, probes=plat_probes):
        detail = c.detail + (caveat if c.name == "unit_control" and not c.ok else "")
        r.add(f"platform.{c.name}", c.ok, detail, c.hint or "see `kandev status` and docs/operations.md")
    return path


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def _owner(st: os.stat_result) -> str:
    try:
        u = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        u = str(st.st_uid)
    try:
        g = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        g = str(st.st_gid)
    return f"{u}:{g}"


def _stat(path: Path) -> os.stat_result | None | str:
    """lstat, None if missing, or the error text if we may not look."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _access_hint(probes: DoctorProbes) -> str:
    if probes.service_gid() is not None:
        return ("run as root, or as a member of the kandev group: `adduser $USER kandev`, "
                "then log in again")
    return "run as the user that runs the backend (or root)"


def _permissions(r: _Report, paths: Paths, probes: DoctorProbes) -> dict[str, Any] | None:
    """Home, run dir, secrets, sockets; returns the backend's status when it answered."""
    start_hint = (f"start the backend: `systemctl start {BACKEND_UNIT}` (or `kandev up`); it creates the home")
    home = _stat(paths.home)
    if home is None:
        r.add("home", False, f"{paths.home} does not exist", start_hint)
        return None
    if isinstance(home, str):
        r.add("home", False, f"{paths.home}: {home}", _access_hint(probes))
        return None
    loose = stat.S_IMODE(home.st_mode) & 0o027
    r.add("home", stat.S_ISDIR(home.st_mode) and not loose,
          f"{paths.home} {_owner(home)} {_mode(home)}",
          f"chmod 0750 {paths.home} (it holds the store, logs and worktrees)")
    owner_uid = home.st_uid

    run = _stat(paths.run_dir)
    if isinstance(run, os.stat_result):
        m = stat.S_IMODE(run.st_mode)
        ok = stat.S_ISDIR(run.st_mode) and run.st_uid == owner_uid and m in (0o700, 0o750)
        r.add("run_dir", ok, f"{paths.run_dir} {_owner(run)} {_mode(run)} (0700, or 0750 for the kandev group)",
              f"chown to the home's owner and chmod 0750 {paths.run_dir} (the backend sets it at start)")
    elif run is None:
        r.add("run_dir", False, f"{paths.run_dir} does not exist", start_hint)
    else:
        r.add("run_dir", False, f"{paths.run_dir}: {run}", _access_hint(probes))

    sec = _stat(paths.secrets_dir)
    if isinstance(sec, os.stat_result):
        ok = stat.S_ISDIR(sec.st_mode) and sec.st_uid == owner_uid and stat.S_IMODE(sec.st_mode) == 0o700
        r.add("secrets_dir", ok, f"{paths.secrets_dir} {_owner(sec)} {_mode(sec)} (must be 0700)",
              f"chmod 0700 {paths.secrets_dir}; it holds the control-server credentials")
    elif sec is None:
        r.add("secrets_dir", False, f"{paths.secrets_dir} does not exist", start_hint)
    else:
        r.add("secrets_dir", True, f"{paths.secrets_dir}: {sec} (private to the backend's user, as intended)")

    status = None
    sock = _stat(paths.backend_socket)
    if isinstance(sock, os.stat_result):
        m = stat.S_IMODE(sock.st_mode)
        shape = f"{paths.backend_socket} {_owner(sock)} {_mode(sock)}"
        if not stat.S_ISSOCK(sock.st_mode) or m & 0o007 or sock.st_uid != owner_uid:
            r.add("backend_socket", False, shape + " (must be a socket, 0600 or 0660, owned like the home)",
                  f"restart the backend (`systemctl restart {BACKEND_UNIT}`): it recreates the socket")
        else:
            me = probes.euid()
            may = me in (0, sock.st_uid) or (m & 0o060 == 0o060 and sock.st_gid in probes.groups())
            status = probes.backend_status(paths.backend_socket) if may else None
            if not may:
                r.add("backend_socket", False, shape + f": uid {me} may not connect", _access_hint(probes))
            elif status is None:
                r.add("backend_socket", False, shape + ": nobody answers (stale socket, or the backend is busy)",
                      f"see `journalctl -u {BACKEND_UNIT} -b`; `systemctl restart {BACKEND_UNIT}`")
            else:
                b = status.get("backend", {})
                r.add("backend_socket", True, shape + f": backend {b.get('state', '?')}, pid {b.get('pid', '?')}, "
                      f"version {b.get('version', '?')}")
    elif sock is None:
        r.add("backend_socket", False, f"{paths.backend_socket} does not exist: the backend is not running",
              start_hint)
    else:
        r.add("backend_socket", False, f"{paths.backend_socket}: {sock}", _access_hint(probes))

    try:
        names = sorted(p for p in os.listdir(paths.run_dir) if p.startswith("agentctl-") and p.endswith(".sock"))
    except OSError:
        names = []
    loose_socks = []
    for name in names:
        st = _stat(paths.run_dir / name)
        if isinstance(st, os.stat_result) and stat.S_IMODE(st.st_mode) & 0o077:
            loose_socks.append(f"{name} {_mode(st)}")
    if names:
        r.add("agentctl_sockets", not loose_socks,
              f"{len(names)} control-server socket(s), " + (", ".join(loose_socks) if loose_socks else "all 0600"),
              "restart the control server with the backend; its sockets must be 0600 (owner only)")
    return status


def _control_server(r: _Report, status: dict[str, Any] | None) -> None:
    """What the running backend says about its control server(s); nothing when it did not answer."""
    if status is None or not isinstance(status.get("control_server"), dict):
        return
    server = status["control_server"]
    for name, link in (("control_server", server), ("control_server.passthrough", server.get("passthrough") or {})):
        state = link.get("state")
        if state is None or (name != "control_server" and state == LinkState.NONE):
            continue
        loss = link.get("gave_up") or link.get("last_loss") or {}
        last = f"; last loss {loss.get('at')}: {loss.get('reason')}" if loss else ""
        if state == LinkState.GAVE_UP:
            window = link.get("crash_loop") or {}
            r.add(name, False, f"gave up restarting it after {window.get('limit', '?')} losses within "
                  f"{window.get('window_s', '?')} s{last}",
                  "see `journalctl KANDEV_EVENT=control_server_lost` (or the backend log) and the control-server"
                  " log for why it dies; once fixed, `kandev up` makes the backend try again")
        elif state in (LinkState.LOST, LinkState.RESTARTING):
            r.add(name, False, f"{state}: the backend is starting a new one{last}",
                  "wait a few seconds and look again; `kandev status` shows the state")
        elif state == LinkState.SUPERSEDED:
            r.add(name, False, "superseded: another holder of this installation's credential adopted it; this"
                  " backend no longer drives it", "restart the backend (`kandev down` then `kandev up`, or"
                  " `systemctl restart kandev-backend`)")
        elif state == LinkObserved.UNREACHABLE:
            r.add(name, False, f"running but not answering, pid {link.get('pid', server.get('pid'))}",
                  "see the control-server log; `systemctl kill --kill-whom=main -s USR1` dumps its tasks")
        else:
            detail = f"{state}" + (f", pid {link.get('pid')}" if link.get("pid") else "")
            detail += f" ({link.get('restarts')} restart(s) after losses{last})" if link.get("restarts") else ""
            running, installed = link.get("version"), link.get("installed_version")
            if link.get("replacement") == "when_idle":
                r.add(name, True, f"{detail}; predates in-place reload: version {installed} replaces it once it runs"
                      " no instance")
            elif link.get("can_reload") and running and installed and running != installed:
                r.add(name, False, f"{detail}; runs version {running}, {installed} is installed",
                      "`kandev agentctl reload` (or `systemctl reload kandev-agentctl`) runs the installed code"
                      " in place, every agent kept; if it is refused, the journal says why"
                      " (KANDEV_EVENT=reload_refused)")
            else:
                r.add(name, True, detail + (f", version {running}" if running else ""))


def _password(config: Config | None) -> dict[str, str]:
    """The database password (database.password_file) when this user may read it: without it the
    server's refusal is what the store check reports."""
    if config is None:
        return {}
    from daemon.config.database import connect_args
    from daemon.config.keys import ConfigError

    try:
        return connect_args(config)
    except ConfigError:
        return {}


def _store(r: _Report, config: Config | None, view: dict[str, Any] | None, paths: Paths,
           probes: DoctorProbes) -> None:
    head = probes.head_revision()
    url = config.database.url if config is not None else None
    if view is not None and hidden(view, "database.url"):  # the running backend's: never shown
        url = database_url(view.get("file"))
        if url is None:
            r.add("store", True, f"database.url (not shown): the running backend (pid {view.get('pid')}) has its"
                  " store open; `kandev doctor --config FILE` reads it from a file this user may read")
            return
    if url:
        try:
            from sqlalchemy import create_engine, text

            engine = create_engine(url, pool_pre_ping=True, connect_args=_password(config))
            try:
                with engine.connect() as conn:
                    rev = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            finally:
                engine.dispose()
        except Exception as exc:  # any driver error: report it, it is what the operator must fix
            r.add("store", False, f"database.url: cannot read the store: {type(exc).__name__}: {exc}",
                  "check database.url, that the server is up and that its driver is installed")
            return
        where = "database.url"
    else:
        db = paths.db_path
        if not db.exists():
            r.add("store", False, f"{db} does not exist",
                  f"start the backend (`systemctl start {BACKEND_UNIT}` or `kandev up`): it creates and migrates it")
            return
        try:
            lite = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
            try:
                known = lite.execute(
                    "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'").fetchone()
                row = lite.execute("SELECT version_num FROM alembic_version").fetchone() if known else None
            finally:
                lite.close()
        except sqlite3.Error as exc:
            hint = (f"run `sudo kandev doctor`: {db} is readable by its owner only" if not os.access(db, os.R_OK)
                    else (
                f"the file may be damaged: stop the backend, keep a copy of {db}, see the journal"))
            r.add("store", False, f"{db}: cannot open read-only: {exc}", hint)
            return
        rev = row[0] if row else None
        where = str(db)
    if rev is None:
        r.add("store", False, f"{where}: no alembic revision (not a kandev store?)",
              "point database.url (or the home) at the kandev store; the backend migrates it at start")
    elif head is None or rev == head:
        r.add("store", True, f"{where}: revision {rev}" + (" (head)" if head else ""))
    else:
        r.add("store", True, f"{where}: revision {rev}, this version's head is {head}: the backend migrates "
              "it at its next start")


def _store_space(r: _Report, paths: Paths, status: dict[str, Any] | None) -> None:
    """Out of space as the running backend found it (Issue 21 item 5), else the free bytes of the home."""
    store = (status or {}).get("store")
    full = store.get("out_of_space") if isinstance(store, dict) else None
    size = f"; the store takes {store.get('bytes')} bytes" if isinstance(store, dict) and store.get("bytes") else ""
    if full:
        why = ("agents' writes there wait for space, so their turns stall" if full.get("cause") == "no_free_space"
               else "the backend cannot write events, agents wait at their bound with the control server")
        r.add("store_space", False, f"{full.get('path')} is out of space ({full.get('free_bytes')} bytes free){size}:"
              f" {why}",
              "free some space on that filesystem (or `kandev store vacuum` once it can write): the backend"
              " catches up on its own, every chunk once and in order")
        return
    try:
        st = os.statvfs(paths.home)
    except OSError as exc:
        r.add("store_space", False, f"{paths.home}: {exc}")
        return
    free = st.f_bavail * st.f_frsize
    low = free < LOW_SPACE_BYTES
    r.add("store_space", not low, f"{free} bytes free on {paths.home}{size}",
          "free some space: with none left the backend stops taking events (nothing is lost, agents pause)"
          if low else None)


def _tools(r: _Report, path: str | None, probes: DoctorProbes) -> None:
    where = "the backend's PATH" if path == SERVICE_PATH else "PATH"
    for tool in ("node", "npm"):
        exe = probes.which(tool, path)
        if exe is None:
            r.add(tool, False, f"{tool} not found on {where}",
                  "apt-get install nodejs npm (npm-based agents need them; the built-in mock agent does not)")
        else:
            r.add(tool, True, f"{exe} {probes.version(exe) or '(version unknown)'}")


def _sandbox(r: _Report, config: Config | None, status: dict[str, Any] | None, path: str | None,
             env: Mapping[str, str], probes: DoctorProbes) -> None:
    cfg = config or Config()
    probe = lambda: probes.sandbox_probe({**env, "PATH": path or env.get("PATH", "")})  # noqa: E731
    r.checks.extend(sandbox_checks(cfg.agents.sandbox, cfg.network.mode, (status or {}).get("sandbox"), probe))


def _agent_limits(r: _Report, config: Config | None) -> None:
    """Which uid agents run as, the process cap and how the kernel enforces it, the OOM order."""
    from daemon.agentctl.instance.process import AGENT_OOM_SCORE_ADJ
    from daemon.core.service import DAEMON_OOM_SCORE_ADJ
    from daemon.host.agent_user import AgentUserMissing, agent_user, describe

    cfg = config or Config()
    try:
        user = agent_user()
    except AgentUserMissing as exc:
        r.add("agent_user", False, str(exc), "create the user: systemd-sysusers, or bash packaging/dev/setup.sh")
        return
    who = (f"agents run as {describe(user)}, never root nor the service user" if user.dedicated
           else f"agents run as the service user {describe(user)}, in their own user namespace")
    r.add("agent_user", True, who)
    enforced = ("not enforced: agents.sandbox = \"off\"" if cfg.agents.sandbox == "off" else
                "RLIMIT_NPROC set in each agent's sandbox; the kernel counts it in that agent's own user"
                " namespace, so one agent's fork bomb fails inside that agent only")
    r.add("agent_limits", True, f"agents.max_processes = {cfg.agents.max_processes} processes per agent ({enforced});"
          f" oom_score_adj {AGENT_OOM_SCORE_ADJ:+d} for agents, {DAEMON_OOM_SCORE_ADJ:+d} for the daemons (units,"
          " or run as root)")


def run_doctor(
    paths: Paths,
    *,
    config_path: str | None = None,
    env: Mapping[str, str] | None = None,
    probes: DoctorProbes | None = None,
) -> list[Check]:
    """Every check, in order; see the module docstring."""
    environ = os.environ if env is None else env
    p = probes or DoctorProbes()
    r = _Report()
    config, view, checks = configuration(p.backend_config(paths.backend_socket) if config_path is None else None,
                                         config_path, environ)
    r.checks += checks
    states = _units(r, p)
    path = _platform(r, config, environ, p, states)
    status = _permissions(r, paths, p)
    _control_server(r, status)
    _store(r, config, view, paths, p)
    _store_space(r, paths, status)
    _tools(r, path, p)
    _sandbox(r, config, status, path, environ, p)
    _agent_limits(r, config)
    r.checks.append(doctor_memory.agent_memory(config or Config(), (status or {}).get("memory"), p.memory_controller))
    r.checks += agent_checks(view)
    return r.checks


def as_json(checks: Sequence[Check]) -> dict[str, Any]:
    return {
        "ok": all(c.ok for c in checks),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail, "hint": c.hint} for c in checks],
    }


def as_text(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}")
        if not c.ok and c.hint:
            lines.append(f"      {'':<{width}}  fix: {c.hint}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"doctor: {len(checks)} checks, {failed} failing" if failed else f"doctor: all {len(checks)} checks pass")
    return "\n".join(lines)
