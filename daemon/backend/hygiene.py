"""Keeping the Kandev home private: modes, and credential files nobody needs any more.

Rules (run by the backend once its startup recovery is done, off the event loop):

- Everything under the home is the service user's alone: no group or other permission bit
  (kandev's own directories 0700, its files 0600; a file an agent made keeps its owner bits, e.g.
  an executable stays executable for its owner). The exceptions are what members of the ``kandev`` group must reach to use the CLI: the run directory
  (0750 when the backend runs as that group, see ``daemon.paths.run_dir_mode``) and the backend's
  socket in it (0660). The home itself is left as systemd's ``StateDirectoryMode=`` (or the
  operator) made it: the group needs to traverse it to reach the run directory.
- The walk covers kandev's own files: the top level (store, lock, installation id), ``logs``
  (``backend.log`` and the agents' stderr files included), ``secrets``, ``agentctl``, ``run``,
  ``sessions`` and, of ``worktrees``, the directory and each worktree's top directory (a
  workspace's own content is the agent's work: with its top directory 0700 nobody else reaches it).
  Symlinks are never followed, files of other owners never touched.
- A secret file (``secrets/``) whose mode is loose is left as it is: it may have been read, kandev
  refuses to use it (``daemon.paths.read_secret_file``), and making it private would launder it.
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
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from daemon.agentctl import auth
from daemon.agentctl.launch import LaunchError, read_credential_file
from daemon.journal import log_event
from daemon.paths import Paths, run_dir_mode
from daemon.store.models import ControlServerRecord
from ipc.client import AsyncClient
from ipc.errors import ErrorCode, IpcError

if TYPE_CHECKING:
    from daemon.backend.context import BackendContext

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


def _fix(path: Path, want: int | None, out: Tidied) -> None:
    """Set ``path``'s mode to ``want`` (None: its own mode without group and other bits)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid():
        return
    have = stat.S_IMODE(st.st_mode)
    if want is None:
        want = have & ~0o077
    if have != want:
        try:
            os.chmod(path, want, follow_symlinks=False)
        except OSError:
            return
        out.modes.append(f"{path} {have:04o}->{want:04o}")


def _walk(top: Path, limit: int) -> Iterator[tuple[Path, bool]]:
    """(path, is_dir) of everything below ``top``, never through a symlink."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        base = Path(dirpath)
        for name in dirnames:
            seen += 1
            yield base / name, not (base / name).is_symlink()
        for name in filenames:
            seen += 1
            yield base / name, False
        if seen >= limit:
            return


def tidy_home(paths: Paths, keep_credentials: Collection[str]) -> Tidied:
    """One pass of the rules above (blocking); ``keep_credentials``: the ``agentctl-cred-*`` names
    in use."""
    out = Tidied()
    home = paths.home
    try:
        top = list(os.scandir(home))
    except OSError:
        return out
    for entry in top:
        path = Path(entry.path)
        if entry.is_symlink():
            continue
        if entry.name == paths.run_dir.name and entry.is_dir():
            _fix(path, run_dir_mode(), out)
            for sock in path.iterdir():
                if sock.is_socket() and not sock.is_symlink():
                    _fix(sock, 0o660 if sock == paths.backend_socket else 0o600, out)
                elif not sock.is_symlink():
                    _fix(sock, 0o700 if sock.is_dir() else 0o600, out)
        elif entry.name == paths.worktrees_dir.name and entry.is_dir():
            _fix(path, 0o700, out)
            for tree in path.iterdir():
                if tree.is_dir() and not tree.is_symlink():
                    _fix(tree, 0o700, out)
        elif entry.is_dir():
            _fix(path, 0o700, out)
            if entry.name in PRIVATE_DIRS:
                for sub, _is_dir in _walk(path, MAX_ENTRIES):
                    if sub.parent == paths.secrets_dir and not _is_dir:
                        continue  # a loose secret stays refused, never laundered (see above)
                    _fix(sub, None, out)
        else:
            _fix(path, 0o600, out)
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
        rec = db.get(ControlServerRecord, 1)
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
