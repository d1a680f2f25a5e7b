"""Creating (and removing) a listening Unix socket at a filesystem path, safely.

Rules, in order:

- filesystem paths only: an abstract name (leading NUL or ``@``) is refused,
  because abstract sockets have no permissions and outlive no directory;
- the parent directory must exist, be owned by us or root, and be neither
  group- nor world-writable (otherwise someone else could swap the socket);
- an existing socket file is probed: if something accepts the connection it
  is live and is never unlinked (``SocketInUseError``); if the connection is
  refused it is stale and is removed; a non-socket file is never touched;
- the check, unlink, bind, chmod and listen happen under an exclusive
  ``flock`` on the parent directory, so two servers racing for one path
  cannot both win, and the socket's mode is set before ``listen()`` so no
  peer can connect while it still has the umask's mode.

On close, the socket file is removed only if it is still the inode we bound.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat

SocketIdentity = tuple[int, int]
"""(st_dev, st_ino) of the socket file we bound."""

_MAX_PATH_BYTES = 107  # sizeof(sun_path) - 1 for the terminating NUL


class SocketInUseError(OSError):
    """A live server already listens at the path."""

    def __init__(self, path: str) -> None:
        super().__init__(
            errno.EADDRINUSE, f"a server is already listening on {path}; refusing to replace it", path
        )


def check_socket_path(path: str | os.PathLike[str]) -> str:
    """Validate a socket path and return it absolute. Raises ValueError/OSError."""
    raw = os.fspath(path)
    if not isinstance(raw, str):
        raise ValueError("socket path must be a str")
    if not raw or raw[0] in ("\0", "@"):
        raise ValueError(f"abstract socket names are refused ({raw!r}); use a filesystem path")
    if "\0" in raw:
        raise ValueError(f"socket path contains a NUL byte: {raw!r}")
    full = os.path.abspath(raw)
    if len(os.fsencode(full)) > _MAX_PATH_BYTES:
        raise ValueError(f"socket path is longer than {_MAX_PATH_BYTES} bytes: {full}")
    return full


def check_parent_dir(path: str) -> str:
    """Check that the directory holding ``path`` is private enough; return it."""
    parent = os.path.dirname(path)
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"socket directory {parent} does not exist", parent) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{parent} is not a directory", parent)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            errno.EPERM,
            f"refusing to create socket {path}: directory {parent} is group- or world-writable "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); use a directory of mode 0700 or 0755",
            parent,
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionError(
            errno.EPERM,
            f"refusing to create socket {path}: directory {parent} belongs to uid {st.st_uid}",
            parent,
        )
    return parent


def _remove_stale(path: str) -> None:
    """Unlink a dead socket at ``path``; refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(
            errno.EEXIST, f"{path} exists and is not a socket; refusing to replace it", path
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)  # nobody listens: a leftover of a dead server
        return
    except BlockingIOError:
        raise SocketInUseError(path) from None  # backlog full: very much alive
    except FileNotFoundError:
        return  # vanished meanwhile
    except OSError as exc:
        raise OSError(exc.errno, f"cannot probe existing socket {path}: {exc.strerror}", path) from None
    finally:
        probe.close()
    raise SocketInUseError(path)


LISTEN_BACKLOG = 1024
"""The accept queue of every listening socket: peers that connect while the server is busy (or
re-executing, with the socket handed over) wait there instead of being refused."""


def bind_listener(
    path: str | os.PathLike[str], mode: int, backlog: int = LISTEN_BACKLOG
) -> tuple[socket.socket, str, SocketIdentity]:
    """Bind and listen on ``path``; return the non-blocking socket, its absolute path and identity."""
    full = check_socket_path(path)
    parent = check_parent_dir(full)
    dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX)
        _remove_stale(full)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bound = False
        try:
            sock.bind(full)
            bound = True
            os.chmod(full, mode)
            st = os.lstat(full)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            if bound:
                try:
                    os.unlink(full)
                except OSError:
                    pass
            raise
        return sock, full, (st.st_dev, st.st_ino)
    finally:
        os.close(dir_fd)  # releases the flock


def unlink_if_ours(path: str, identity: SocketIdentity | None) -> bool:
    """Remove the socket file if it is still the one we bound."""
    if identity is None:
        return False
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != identity:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
