"""Which host user an agent runs as, and handing it what kandev creates for a session.

No agent is ever host root. When kandev runs as root (a development machine, the tests), every
agent runs as the dedicated unprivileged system user ``kandev-agent`` (created by the package's
sysusers.d file and by ``packaging/dev/setup.sh``), which owns nothing of kandev's. When kandev runs
unprivileged (the units: ``User=kandev``), agents keep the service uid: leaving it would need
``CAP_SETUID`` in the control server (docs/architecture.md, "Which uid an agent is").

What kandev creates for a session (its agent directories, a worktree or an empty workspace) is
given to the agent's uid (``give``, a walk that never follows a symlink); a workspace a user hands
over is never re-owned: one the agent's uid cannot write is refused (``check_writable``) with a
message naming the uid and the fix.
"""

from __future__ import annotations

import os
import pwd
import stat
from dataclasses import dataclass

AGENT_USER = "kandev-agent"
CREATE_HINT = (f"create it with `systemd-sysusers` (the package ships /usr/lib/sysusers.d/kandev.conf), "
               f"`bash packaging/dev/setup.sh`, or `useradd --system --no-create-home --shell /usr/sbin/nologin"
               f" {AGENT_USER}`")
_WALK_LIMIT = 500_000


class AgentUserMissing(RuntimeError):
    """kandev runs as root and the ``kandev-agent`` user does not exist (or is root)."""


@dataclass(frozen=True)
class AgentUser:
    """The host identity of every agent this process starts. ``dedicated``: not our own uid (we run
    as root and agents run as ``kandev-agent``)."""

    uid: int
    gid: int
    name: str
    dedicated: bool


def agent_user() -> AgentUser:
    """The host user agents run as (see the module docstring); AgentUserMissing as root without it."""
    euid = os.geteuid()
    if euid != 0:
        try:
            name = pwd.getpwuid(euid).pw_name
        except KeyError:
            name = str(euid)
        return AgentUser(euid, os.getegid(), name, False)
    try:
        pw = pwd.getpwnam(AGENT_USER)
    except KeyError:
        raise AgentUserMissing(f"kandev runs as root and the user {AGENT_USER!r} that agents run as does not"
                               f" exist: {CREATE_HINT}") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise AgentUserMissing(f"the user {AGENT_USER!r} has uid {pw.pw_uid} / gid {pw.pw_gid}: agents are never"
                               " root; make it an unprivileged system user")
    return AgentUser(pw.pw_uid, pw.pw_gid, AGENT_USER, True)


def describe(user: AgentUser) -> str:
    return f"{user.name} (uid {user.uid})"


# ---------------------------------------------------------------- what kandev creates


def _chown_fd(fd: int, user: AgentUser) -> None:
    st = os.fstat(fd)
    if st.st_uid != user.uid or st.st_gid != user.gid:
        os.fchown(fd, user.uid, user.gid)


def give(path: str | os.PathLike[str], user: AgentUser | None = None, *, recursive: bool = True) -> None:
    """Give ``path`` (a directory kandev just created for a session) and, ``recursive``, everything
    below it to the agent's uid. Every component is opened relative to its parent's descriptor
    without following a symlink (a symlink itself is re-owned, never what it names). No-op when
    agents run as our own uid. Blocking: call it off the event loop."""
    user = agent_user() if user is None else user
    if not user.dedicated:
        return
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        give_fd(top, user, recursive=recursive)
    finally:
        os.close(top)


def give_file(path: str | os.PathLike[str], user: AgentUser | None = None) -> None:
    """Give one file kandev just wrote for the agent (its lease) to the agent's uid; a symlink put
    in its place is re-owned itself, never what it names."""
    user = agent_user() if user is None else user
    if user.dedicated:
        os.chown(path, user.uid, user.gid, follow_symlinks=False)


def give_fd(fd: int, user: AgentUser, *, recursive: bool = True) -> None:
    """``give`` for a directory already open at ``fd``."""
    if not user.dedicated:
        return
    _chown_fd(fd, user)
    if recursive:
        _give_below(fd, user, [0])


def _give_below(dir_fd: int, user: AgentUser, seen: list[int]) -> None:
    for name in os.listdir(dir_fd):
        seen[0] += 1
        if seen[0] > _WALK_LIMIT:
            raise OSError(f"more than {_WALK_LIMIT} entries: not a tree kandev just created")
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            os.chown(name, user.uid, user.gid, dir_fd=dir_fd, follow_symlinks=False)
            continue
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                _chown_fd(fd, user)
                _give_below(fd, user, seen)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                _chown_fd(fd, user)
            finally:
                os.close(fd)


# ---------------------------------------------------------------- what a user hands over


def _may(st: os.stat_result, user: AgentUser, groups: set[int], bits: tuple[int, int, int]) -> bool:
    """Whether ``user`` has every permission ``bits`` (owner, group, other masks) on ``st``."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == user.uid:
        return mode & bits[0] == bits[0]
    if st.st_gid in groups:
        return mode & bits[1] == bits[1]
    return mode & bits[2] == bits[2]


def _groups(user: AgentUser) -> set[int]:
    try:
        return set(os.getgrouplist(user.name, user.gid))
    except (KeyError, OSError):
        return {user.gid}


def cannot_write(path: str | os.PathLike[str], user: AgentUser | None = None) -> str | None:
    """Why the agent's uid cannot write the directory ``path`` (None: it can). Only the directory's
    own permissions count: the sandbox binds it, so the directories above it need not be reachable.
    ACLs are not evaluated (a workspace shared through an ACL is checked by its mode bits)."""
    user = agent_user() if user is None else user
    if not user.dedicated:
        return None  # agents run as our own uid: whatever we may hand over, they may use
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    write = (stat.S_IWUSR | stat.S_IXUSR, stat.S_IWGRP | stat.S_IXGRP, stat.S_IWOTH | stat.S_IXOTH)
    if _may(st, user, _groups(user), write):
        return None
    return (f"{path} (owner uid {st.st_uid}, group {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}) is not writable"
            f" by {describe(user)}, the user agents run as")


def fix_hint(path: str | os.PathLike[str], user: AgentUser | None = None) -> str:
    user = agent_user() if user is None else user
    return (f"give it to that user (`chown -R {user.name}: {path}`) or share it through a group it is in"
            f" (e.g. `chgrp -R {user.name} {path} && chmod -R g+rwX {path}`); kandev never changes the owner or"
            " mode of files you hand over")



def check_workspace(path: str | os.PathLike[str], what: str = "workspace") -> None:
    """Refuse (``IpcError(workspace_not_writable)``) a directory the agent's uid cannot write,
    naming the uid and the fix. Blocking (a stat): call it off the event loop."""
    from ipc.errors import ErrorCode, IpcError

    try:
        user = agent_user()
    except AgentUserMissing as exc:
        raise IpcError(ErrorCode.SANDBOX_UNAVAILABLE, str(exc), retryable=False) from None
    why = cannot_write(path, user)
    if why is not None:
        raise IpcError(ErrorCode.WORKSPACE_NOT_WRITABLE, f"the {what} {why}: {fix_hint(path, user)}",
                       retryable=False, details={"path": os.fspath(path), "uid": user.uid, "user": user.name})
