"""Keeping the Kandev home private: modes, and credential files nobody needs any more.

Rules (run by the backend once its startup recovery is done, off the event loop):

- Everything under the home is the service user's alone: no group or other permission bit
  (kandev's own directories 0700, its files 0600; a file an agent made keeps its owner bits, e.g.
  an executable stays executable for its owner). The exceptions are what members of the ``kandev`` group must reach to use the CLI: the run directory
  (0750 when the backend runs as that group, see ``daemon.host.paths.run_dir_mode``) and the backend's
  socket in it (0660). The home itself is left as systemd's ``StateDirectoryMode=`` (or the
  operator) made it: the group needs to traverse it to reach the run directory.
- The walk covers kandev's own files: the top level (store, lock, installation id), ``logs``
  (``backend.log`` and the agents' stderr files included), ``secrets``, ``agentctl``, ``run``,
  ``sessions`` and, of ``worktrees``, the directory and each worktree's top directory (a
  workspace's own content is the agent's work: with its top directory 0700 nobody else reaches it).
  Symlinks are never followed, files of other owners never touched: every component is opened
  relative to its parent's descriptor with ``O_NOFOLLOW`` and its mode set through that
  descriptor, so swapping a directory for a symlink mid-walk redirects nothing. A session's
  ``endpoint/`` keeps 0711 when agents run as another uid (kandev as root: its agent reaches the
  socket in it) and is 0700 like the rest when they keep ours (the units).
- A secret file (``secrets/``) whose mode is loose is left as it is: it may have been read, kandev
  refuses to use it (``daemon.host.paths.read_secret_file``), and making it private would launder it.
- ``secrets/agentctl-cred-*`` of control servers that are gone are removed. Kept: the recorded
  server's credential, those of the servers this backend runs, and every credential a control
  server still answering in ``run/`` proves it holds (a survivor this backend did not adopt keeps
  running until its unowned shutdown, and its credential is not thrown away); a server there that
  cannot answer at that moment (re-executing in place: it keeps its credentials across a reload)
  keeps every candidate for this pass. The bootstrap credential
  (``secrets/agentctl-bootstrap``, read by systemd when it starts ``kandev-agentctl.service``) is
  removed by the launcher once the server answered; a leftover (a backend that died between
  writing it and starting the unit) is removed here.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.agentctl import auth
from daemon.agentctl.launch import LaunchError, read_credential_file
from daemon.backend.cluster.identity import ClusterIdentity
from daemon.core.journal import log_event
from daemon.host.agent_user import AgentUserMissing, agent_user
from daemon.host.paths import Paths, run_dir_mode
from daemon.host.session_dirs import ENDPOINT_DIR, SESSIONS_DIR, endpoint_mode
from ipc.client import AsyncClient
from ipc.errors import ErrorCode, IpcError

if TYPE_CHECKING:
    from daemon.backend.lifetime.context import BackendContext

CREDENTIAL_PREFIX = "agentctl-cred-"
BOOTSTRAP = "agentctl-bootstrap"
PRIVATE_DIRS = ("logs", "secrets", "agentctl", "sessions", "agents")
PROVE_TIMEOUT_S = 2.0
MAX_ENTRIES = 200_000  # a bound on the walk (agents' state can be large); the rest waits for the next start


@dataclass
class Tidied:
    """What one pass changed."""

    modes: list[str] = field(default_factory=list)  # "path 0640->0600"
    removed: list[str] = field(default_factory=list)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _set_mode(fd: int, st: os.stat_result, want: int | None, shown: str, out: Tidied) -> None:
    """Set the mode of what ``fd`` holds (an O_PATH or open descriptor, never a symlink) to ``want``
    (None: its own mode without group and other bits), if it is ours."""
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    have = stat.S_IMODE(st.st_mode)
    if want is None:
        want = have & ~0o077
    if have != want:
        try:
            os.chmod(f"/proc/self/fd/{fd}", want)  # the inode held, whatever the path names now
        except OSError:
            return
        out.modes.append(f"{shown} {have:04o}->{want:04o}")


def _fix_at(dir_fd: int, name: str, want: int | None, shown: str, out: Tidied) -> None:
    """``_set_mode`` of the entry ``name`` of the directory open at ``dir_fd``, opened without
    following a symlink (an agent may swap anything below the home for one at any moment)."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        _set_mode(fd, os.fstat(fd), want, shown, out)
    finally:
        os.close(fd)


def _open_dir_at(dir_fd: int | None, name: str) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS) if dir_fd is None else os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None  # gone, not a directory, or a symlink (ELOOP): never followed


def _tidy_tree(dir_fd: int, shown: str, out: Tidied, budget: list[int], want_dir: Callable[[str], int | None],
               skip_files: bool = False) -> None:
    """Every entry below the directory open at ``dir_fd``: directories by ``want_dir(their shown
    path)``, files without group and other bits; each component opened relative to its parent,
    never through a symlink; at most ``budget[0]`` entries."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for name in names:
        budget[0] -= 1
        if budget[0] < 0:
            return
        sub = f"{shown}/{name}"
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            fd = _open_dir_at(dir_fd, name)
            if fd is None:
                continue
            try:
                _set_mode(fd, os.fstat(fd), want_dir(sub), sub, out)
                _tidy_tree(fd, sub, out, budget, want_dir)
            finally:
                os.close(fd)
        elif not stat.S_ISLNK(st.st_mode) and not skip_files:
            _fix_at(dir_fd, name, None, sub, out)


def tidy_home(paths: Paths, keep_credentials: Collection[str]) -> Tidied:
    """One pass of the rules above (blocking); ``keep_credentials``: the ``agentctl-cred-*`` names
    in use."""
    out = Tidied()
    home = paths.home
    top_fd = _open_dir_at(None, str(home))
    if top_fd is None:
        return out
    try:
        _tidy_top(top_fd, str(home), paths, out)
    finally:
        os.close(top_fd)
    secrets = paths.secrets_dir
    try:
        names = os.listdir(secrets)
    except OSError:
        names = []
    for name in names:
        gone = (name.startswith(CREDENTIAL_PREFIX) and name not in keep_credentials) or name == BOOTSTRAP
        if gone:
            try:
                os.unlink(secrets / name)
                out.removed.append(str(secrets / name))
            except OSError:
                pass
    return out


def _session_dir_modes() -> Callable[[str], int | None]:
    """The wanted mode of a directory under ``sessions/``: ``sessions/<id>/endpoint`` gets
    ``endpoint_mode`` (0711 when the agent is another uid: it reaches its socket); others lose
    group and other bits. As root without the agent user no agent can reach one: 0700."""
    try:
        endpoint = endpoint_mode(agent_user())
    except AgentUserMissing:
        endpoint = 0o700

    def want(shown: str) -> int | None:
        return endpoint if shown.endswith("/" + ENDPOINT_DIR) and shown.count("/") >= 2 else None

    return want


def _tidy_top(top_fd: int, home: str, paths: Paths, out: Tidied) -> None:
    for name in os.listdir(top_fd):
        shown = f"{home}/{name}"
        try:
            st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        if not stat.S_ISDIR(st.st_mode):
            _fix_at(top_fd, name, 0o600, shown, out)
            continue
        fd = _open_dir_at(top_fd, name)
        if fd is None:
            continue
        try:
            if name == paths.run_dir.name:
                _set_mode(fd, os.fstat(fd), run_dir_mode(), shown, out)
                for entry in os.listdir(fd):
                    try:
                        est = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        continue
                    sock = f"{shown}/{entry}"
                    if stat.S_ISSOCK(est.st_mode):
                        _fix_at(fd, entry, 0o660 if sock == str(paths.backend_socket) else 0o600, sock, out)
                    elif not stat.S_ISLNK(est.st_mode):
                        _fix_at(fd, entry, 0o700 if stat.S_ISDIR(est.st_mode) else 0o600, sock, out)
            elif name == paths.worktrees_dir.name:
                _set_mode(fd, os.fstat(fd), 0o700, shown, out)
                for tree in os.listdir(fd):
                    tfd = _open_dir_at(fd, tree)
                    if tfd is not None:
                        try:
                            _set_mode(tfd, os.fstat(tfd), 0o700, f"{shown}/{tree}", out)
                        finally:
                            os.close(tfd)
            else:
                _set_mode(fd, os.fstat(fd), 0o700, shown, out)
                if name in PRIVATE_DIRS:
                    # a loose secret stays refused, never laundered (see above): secrets/ files untouched
                    want = _session_dir_modes() if name == SESSIONS_DIR else (lambda _s: None)
                    _tidy_tree(fd, shown, out, [MAX_ENTRIES], want, skip_files=name == paths.secrets_dir.name)
        finally:
            os.close(fd)


def _candidates(paths: Paths) -> dict[str, bytes | None]:
    """Every ``agentctl-cred-*`` file, with its credential (None when it cannot be read safely)."""
    out: dict[str, bytes | None] = {}
    try:
        names = os.listdir(paths.secrets_dir)
    except OSError:
        return out
    for name in names:
        if name.startswith(CREDENTIAL_PREFIX):
            try:
                out[name] = read_credential_file(paths.secrets_dir / name)
            except LaunchError:
                out[name] = None
    return out


async def _proven(socket_path: Path, candidates: dict[str, bytes], installation_id: str) -> set[str] | None:
    """The candidates the server at ``socket_path`` proves it holds (nothing if nothing listens).
    None when a server is there but cannot answer now: it is re-executing in place (``reloading``,
    or its accepted connection gets no answer in time); it keeps its credentials across that."""
    try:
        conn = await AsyncClient.connect(socket_path, timeout=PROVE_TIMEOUT_S, hello=False)
    except (IpcError, OSError):
        return set()
    try:
        info = await conn.call("identify", timeout=PROVE_TIMEOUT_S)
        identity = info.get("server_identity") if isinstance(info, dict) else None
        if not isinstance(identity, str) or not identity:
            return set()
        challenge = auth.new_challenge()
        answer = await conn.call("prove", {"challenge": challenge}, timeout=PROVE_TIMEOUT_S)
    except IpcError as exc:
        return None if exc.code in (ErrorCode.RELOADING, ErrorCode.TIMEOUT) else set()
    except OSError:
        return set()
    finally:
        await conn.close()
    proofs = answer.get("proofs") if isinstance(answer, dict) else None
    if not isinstance(proofs, list):
        return set()
    return {name for name, cred in candidates.items()
            if any(auth.verify(auth.server_proof(cred, challenge, identity, installation_id), p) for p in proofs[:2])}


async def credentials_in_use(backend: BackendContext) -> set[str]:
    """The ``agentctl-cred-*`` names that must stay (see the module docstring)."""
    keep = {h.credential_ref for h in (backend.handle, backend.passthrough_handle) if h is not None}
    with backend.store.session() as db:
        rec = ClusterIdentity.of(backend.config).record(db)
        if rec is not None and rec.credential_ref:
            keep.add(rec.credential_ref)
    candidates = await asyncio.to_thread(_candidates, backend.paths)
    keep |= {name for name, cred in candidates.items() if cred is None}  # unreadable: not ours to judge
    readable = {name: cred for name, cred in candidates.items() if cred is not None and name not in keep}
    if readable:
        sockets = await asyncio.to_thread(lambda: sorted(backend.paths.run_dir.glob("agentctl-*.sock")))
        for sock in sockets:
            proven = await _proven(sock, readable, backend.installation_id)
            if proven is None:  # cannot tell now whose they are: remove none (the next start will)
                return keep | set(readable)
            keep |= proven
    return keep


async def tidy_home_async(backend: BackendContext) -> Tidied:
    """``tidy_home`` for a backend whose startup recovery is done (the pass runs off the event loop)."""
    keep = await credentials_in_use(backend)
    out = await asyncio.to_thread(tidy_home, backend.paths, keep)
    if out.modes or out.removed:
        log_event("home_tidied", f"home {backend.paths.home}: {len(out.modes)} mode(s) made private"
                  f" ({'; '.join(out.modes[:5])}{' ...' if len(out.modes) > 5 else ''}), {len(out.removed)}"
                  " credential file(s) of servers that are gone removed", priority=5,
                  MODES=len(out.modes), REMOVED=len(out.removed))
    return out
