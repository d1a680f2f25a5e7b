"""Copy an agent's configured files into its session's HOME (``[agents.NAME] home_files``).

Before every launch of an agent (start, resume, a restart by a context reset) the backend copies
each configured host file to ``<HOME>/<destination>``: mode 0600, parent directories created
0700, everything owned by the owner of the HOME itself (whoever the agent runs as owns its HOME).

The HOME is the agent's to write: it may have planted a symlink anywhere below it, at any time.
So the walk never resolves a path: it opens the HOME once (``O_NOFOLLOW``), then each directory
component relative to the one before (``openat`` with ``O_NOFOLLOW | O_DIRECTORY``: a symlink
there is refused, naming the destination), writes the content to a new temporary file in the
final directory (``O_CREAT | O_EXCL | O_NOFOLLOW``) and renames it over the destination (a rename
replaces a planted symlink itself, never what it points at). The source is read with
``O_NOFOLLOW`` and checked like a secret file (``daemon.agents.settings.check_secret_stat``).

Errors are ``HomeFileError`` naming the setting's key (``agents.NAME.home_files.DEST``) and what
is wrong, never a file's contents.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from daemon.agents.settings import HOME_FILE_MAX_BYTES, check_home_dest, check_secret_stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HomeFileError(ValueError):
    """A configured file could not be put into the HOME; ``key`` is the setting it is about."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


def read_source(path: str) -> bytes:
    """The content of a configured host file (blocking): a regular file of root or the service
    user with a secret file's mode, no symlink, at most ``HOME_FILE_MAX_BYTES``. ValueError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc} (a symlink is refused)") from None
    try:
        check_secret_stat(os.fstat(fd), path)
        chunks, size = [], 0
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > HOME_FILE_MAX_BYTES:
                raise ValueError(f"{path} is larger than {HOME_FILE_MAX_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_subdir(parent: int, name: str, owner: tuple[int, int]) -> int:
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
        created = True
    except FileExistsError:
        created = False
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)  # ELOOP / ENOTDIR: a symlink or a file is there
    if created:
        os.fchown(fd, *owner)
    return fd


def _write(home_fd: int, dest: str, data: bytes, owner: tuple[int, int]) -> None:
    *dirs, name = dest.split("/")
    fds: list[int] = []
    try:
        current = home_fd
        for part in dirs:
            current = _open_subdir(current, part, owner)
            fds.append(current)
        tmp = f".{name}.kandev-{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=current)
        try:
            try:
                os.fchown(fd, *owner)
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=current, dst_dir_fd=current)  # replaces a planted link itself
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=current)
            raise
    finally:
        for fd in reversed(fds):
            os.close(fd)


def install(home: str | os.PathLike[str], agent: str, files: Mapping[str, str]) -> list[str]:
    """Copy ``files`` ({destination: host file}) into ``home`` (blocking); the destinations
    written. HomeFileError naming ``agents.AGENT.home_files.DEST``."""
    if not files:
        return []
    try:
        home_fd = os.open(Path(home), _DIR_FLAGS)
    except OSError as exc:
        raise HomeFileError(f"agents.{agent}.home_files", f"cannot open the session's HOME {home}: {exc.strerror}") from None
    written = []
    try:
        st = os.fstat(home_fd)
        owner = (st.st_uid, st.st_gid)
        for dest, source in sorted(files.items()):
            key = f"agents.{agent}.home_files.{dest}"
            try:
                check_home_dest(dest, key)
                data = read_source(source)
            except ValueError as exc:
                raise HomeFileError(key, str(exc).removeprefix(f"{key}: ")) from None
            try:
                _write(home_fd, dest, data, owner)
            except OSError as exc:
                what = exc.strerror or str(exc)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    what = "a directory on the way is a symlink or not a directory (the agent's own; never followed)"
                elif exc.errno == errno.EISDIR:
                    what = "the destination is a directory"
                raise HomeFileError(key, f"cannot write {dest} in the session's HOME: {what}") from None
            written.append(dest)
    finally:
        os.close(home_fd)
    return written
