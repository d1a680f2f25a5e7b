"""The private directories of one session under the Kandev home: what its sandboxed agent may use.

::

    <home>/sessions/<session id>/        0700, the session's own
        agent/                           the agent's own state, read-write in its sandbox (kept across
                                         agent restarts, so a resume finds it: e.g. the mock agent's
                                         persisted sessions)
            home/                        the agent's HOME (e.g. Claude Code's ~/.claude, where its
                                         conversations live, so session/load finds them after a restart)
        git/lease.json                   the session's git credential lease (0600), read-write in the
                                         sandbox: the git helper writes a reissued lease back
        endpoint/git.sock                the session's credential endpoint (served by the backend),
                                         read-only in the sandbox: the directory is bound, not the
                                         socket, so a restarted backend can re-create the socket
        endpoint/git-proxy.sock          the session's git endpoint (served by the backend): the
                                         agent's git reaches its repository through it

Everything is bound at its own path, so an agent sees the same paths with the sandbox on or off;
the rest of the home (store, secrets, sockets, logs, other sessions) stays out of its view.

Owners (``daemon.host.agent_user``): ``agent/`` (with ``home/``) and ``git/`` belong to the agent's uid
(when kandev runs as root, ``kandev-agent``; a directory of ours from before 0.3.0 is given to it
with everything below, by a walk that follows no symlink); the session's own directory and
``endpoint/`` stay ours; ``endpoint/`` is 0711 when the agent is another uid (it reaches the socket
in it, nothing else) and 0700 when agents keep ours (the units: nothing of the home is opened
that nobody needs).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from daemon.host.agent_user import AgentUser, agent_user, give_fd

SESSIONS_DIR = "sessions"
AGENT_STATE_DIR = "agent"
GIT_DIR = "git"
ENDPOINT_DIR = "endpoint"
LEASE_FILE = "lease.json"
ENDPOINT_SOCKET = "git.sock"
PROXY_SOCKET = "git-proxy.sock"
MOCK_STATE_DIR = "mock-sessions"
HOME_DIR = "home"
SHARED_ENDPOINT_MODE = 0o711  # the agent (another uid when kandev runs as root) reaches the socket in it
_SESSION_ID = re.compile(r"^[0-9A-Za-z_-]{1,64}$")


def endpoint_mode(agent: AgentUser) -> int:
    """The mode of a session's ``endpoint/``: traversable by others only when the agent is another
    uid (kandev as root); private when agents keep our uid (``User=kandev``)."""
    return SHARED_ENDPOINT_MODE if agent.dedicated else 0o700


def _private_dir(path: Path, mode: int = 0o700, agent: AgentUser | None = None) -> None:
    """Create ``path`` (its parent must exist); an existing one must be a real directory of ours
    (or, with ``agent``, of the agent's uid), opened without following a symlink; its mode is set
    back to ``mode``. With ``agent``, it is given to the agent's uid (a directory of ours with
    everything below it: one made before agents left our uid)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise OSError(f"{path} exists and is not a directory (a symlink is refused): {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        owners = {os.geteuid()} | ({agent.uid} if agent is not None else set())
        if st.st_uid not in owners:
            raise OSError(f"{path} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        if agent is not None and agent.dedicated and st.st_uid != agent.uid:
            give_fd(fd, agent)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SessionDirs:
    """The directories of one session (see the module docstring)."""

    root: Path

    @classmethod
    def for_session(cls, home: str | os.PathLike[str], session_id: str) -> SessionDirs:
        if not _SESSION_ID.match(session_id):
            raise ValueError(f"not a session id: {session_id!r:.80}")
        return cls(Path(home) / SESSIONS_DIR / session_id)

    @property
    def agent_state(self) -> Path:
        return self.root / AGENT_STATE_DIR

    @property
    def home(self) -> Path:
        """The agent's ``HOME``: private to this session, kept across agent restarts."""
        return self.agent_state / HOME_DIR

    @property
    def git(self) -> Path:
        return self.root / GIT_DIR

    @property
    def endpoint(self) -> Path:
        return self.root / ENDPOINT_DIR

    @property
    def lease_file(self) -> Path:
        return self.git / LEASE_FILE

    @property
    def endpoint_socket(self) -> Path:
        return self.endpoint / ENDPOINT_SOCKET

    @property
    def proxy_socket(self) -> Path:
        """The session's git endpoint (Issue 20; ``daemon.backend.git.endpoint``)."""
        return self.endpoint / PROXY_SOCKET

    @property
    def mock_state(self) -> Path:
        """Where the mock agent persists its sessions (``KANDEV_MOCK_STATE_DIR``)."""
        return self.agent_state / MOCK_STATE_DIR

    def ensure(self) -> SessionDirs:
        """Create every directory with its owner and mode (module docstring; blocking: call it off
        the event loop)."""
        agent = agent_user()
        _private_dir(self.root.parent)
        _private_dir(self.root)
        _private_dir(self.endpoint, endpoint_mode(agent))
        for d in (self.agent_state, self.home, self.git):
            _private_dir(d, 0o700, agent)
        return self
