"""The Kandev home: where every file of an installation lives, and secret files.

The home is ``--home``, else ``$KANDEV_HOME``, else ``$STATE_DIRECTORY`` (the
first entry; systemd sets it for ``StateDirectory=``), else
``~/.local/share/kandev`` (docs/architecture.md#the-home). Everything else is derived from it by
``Paths``.

Sockets (the backend's CLI socket and one new control-server socket per launch)
live in ``<home>/run`` rather than in ``$RUNTIME_DIRECTORY``: systemd removes a
unit's runtime directory when that unit stops, and a control server that
survives the backend must keep its socket.

Secret files (the ownership credential, the bootstrap credential, launch
files) are written 0600 atomically (temp file, fsync, rename, fsync of the
directory) and read back only if they are regular files, not symlinks, owned by
us and exactly 0600.
"""

from __future__ import annotations

import errno
import grp
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from daemon.host.home import BACKEND_SOCKET, resolve_home_dir

# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
SERVICE_GROUP = "kandev"  # the system units' group (packaging/sysusers.d/kandev.conf)
_INSTALLATION_ID = re.compile(r"^[0-9a-f]{32}$")


class PathsError(Exception):
    """A directory or file of the home is unsafe or unusable."""


class SecretFileError(PathsError):
    """A secret file could not be read safely.

    ``reason`` is one of ``missing``, ``symlink``, ``not_regular``,
    ``wrong_owner``, ``bad_mode``, ``malformed``.
    """

    def __init__(self, path: Path, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.reason = reason


def resolve_home(cli_home: str | None, env: Mapping[str, str] | None = None) -> Path:
    """The Kandev home: ``--home``, ``$KANDEV_HOME``, ``$STATE_DIRECTORY``, default
    (``daemon.host.home.resolve_home_dir``, which the CLI uses without pathlib)."""
    return Path(resolve_home_dir(cli_home, env))


class Paths(NamedTuple):
    """Every path of one Kandev home, derived from it. Build with ``Paths.for_home``. (The common
    CLI commands do not import this module: they need only the backend's socket, from
    ``daemon.host.home``.)"""

    home: Path
    run_dir: Path
    secrets_dir: Path
    logs_dir: Path
    worktrees_dir: Path
    agentctl_dir: Path
    db_path: Path
    lock_path: Path
    backend_socket: Path
    agentctl_log: Path
    installation_id_path: Path

    @classmethod
    def for_home(cls, home: Path | str) -> Paths:
        h = Path(home)
        logs = h / "logs"
        return cls(
            home=h,
            run_dir=h / "run",
            secrets_dir=h / "secrets",
            logs_dir=logs,
            worktrees_dir=h / "worktrees",
            agentctl_dir=h / "agentctl",
            db_path=h / "kandev.db",
            lock_path=h / "backend.lock",
            backend_socket=h.joinpath(*BACKEND_SOCKET),
            agentctl_log=logs / "agentctl.log",
            installation_id_path=h / "installation-id",
        )

    def ensure(self) -> None:
        """Create the home's directories.

        The private ones (run, secrets, agentctl) must be real directories
        owned by us; they are refused if they are symlinks and their mode is
        set to 0700 if it differs, except the run directory of the system
        service (see ``run_dir_mode``). The others are created 0700 but an
        existing directory is left as the operator made it.
        """
        _make_dir(self.home, 0o700)
        for d in (self.logs_dir, self.worktrees_dir):
            _make_dir(d, 0o700)
        _ensure_private_dir(self.run_dir, run_dir_mode())
        for d in (self.secrets_dir, self.agentctl_dir):
            _ensure_private_dir(d)

    def new_agentctl_socket_path(self) -> Path:
        """A socket path for one control-server launch, never used before."""
        path = self.run_dir / f"agentctl-{os.urandom(4).hex()}.sock"
        check_socket_path(path)
        return path


def run_dir_mode() -> int:
    """0750 when we run as the ``kandev`` service group (the system units: members of that group
    reach the 0660 CLI socket through it; the control-server sockets in it stay 0600), else 0700."""
    try:
        service_gid = grp.getgrnam(SERVICE_GROUP).gr_gid
    except KeyError:
        return 0o700
    return 0o750 if os.getegid() == service_gid else 0o700


def check_socket_path(path: Path) -> None:
    """Refuse a socket path too long for ``sockaddr_un``."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise PathsError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH_BYTES} bytes;"
            " choose a shorter Kandev home"
        )


def _make_dir(path: Path, mode: int) -> None:
    try:
        os.makedirs(path, mode, exist_ok=True)
    except FileExistsError:
        raise PathsError(f"{path} exists and is not a directory") from None


def _ensure_private_dir(path: Path, mode: int = 0o700) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PathsError(f"{path} is a symlink; refusing to use it for private files")
    if not stat.S_ISDIR(st.st_mode):
        raise PathsError(f"{path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise PathsError(f"{path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode, follow_symlinks=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(directory: Path, name: str, data: bytes) -> Path:
    tmp = directory / f".{name}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def write_secret_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a 0600 file, atomically and durably."""
    tmp = _write_temp(path.parent, path.name, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def read_secret_file(path: Path) -> bytes:
    """Read a secret file; refuse symlinks, non-regular files, other owners, modes but 0600."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise SecretFileError(path, "missing", "does not exist") from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SecretFileError(path, "symlink", "is a symlink; refusing to read it") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(path, "not_regular", "is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretFileError(path, "wrong_owner", f"is owned by uid {st.st_uid}, not by us")
        mode = stat.S_IMODE(st.st_mode)
        if mode != 0o600:
            raise SecretFileError(path, "bad_mode", f"has mode {mode:04o}; it must be 0600")
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def installation_id(paths: Paths) -> str:
    """This home's installation id: 128 random bits in hex, created once, then read back.

    Creation never replaces an existing file (the temp file is hard-linked into
    place), so two processes racing at first start agree on one id. A
    malformed file is an error, never silently replaced: the id is bound into
    every ownership proof.
    """
    path = paths.installation_id_path
    if not os.path.lexists(path):
        tmp = _write_temp(path.parent, path.name, (os.urandom(16).hex() + "\n").encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(path.parent)
    value = read_secret_file(path).decode("ascii", errors="replace").strip()
    if not _INSTALLATION_ID.match(value):
        raise SecretFileError(path, "malformed", "does not hold a 32-hex-digit installation id")
    return value
