"""The agent side of a session's git credential lease (Issue 5, Issue 20).

The lease token (and the reissue capability) live in the session's 0600 **lease file**; this
module owns its format (``read_lease_file`` / ``write_lease_file``) and checks the lease with the
session's credential endpoint before kandev's git transport (``daemon.git_transport``) presents it
to the session's git endpoint (``valid_lease``): ``credential_redeem`` on the socket it is given,
and, if the endpoint answers that the lease is invalid, expired or revoked and the file holds a
capability, exactly one ``credential_reissue`` whose new lease is written back (LEASE-CTX-3).

The redemption gives no upstream credential: since Issue 20 the upstream GitHub token is used by
kandev's git endpoint outside the sandbox only, and kandev configures no git credential helper for
the agent. The lease token and the capability never appear in the environment, in argv or on
stderr. The module stays light (no database code): git starts the transport for every fetch and push.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from daemon.host.agent_user import AgentUserMissing, agent_user
from daemon.host.paths import PathsError, read_secret_file, write_secret_file

LEASE_FILE_ENV = "KANDEV_GIT_LEASE_FILE"
SOCKET_ENV = "KANDEV_BACKEND_SOCKET"
# The broker's lease failures after which one reissue is tried (daemon.credentials.errors).
REISSUABLE_CODES = frozenset({"lease_invalid", "lease_expired", "lease_revoked"})
TIMEOUT_S = 15.0


class HelperError(Exception):
    """A final refusal, with a stable ``code``; its message never holds a secret."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------- the lease file


def _ensure_private_dir(path: Path, owners: set[int] | None = None) -> None:
    if owners is None:
        owners = _lease_dir_owners()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners:
        raise OSError(f"{path} is not a directory owned by us; refusing to put a lease file in it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _lease_dir_owners() -> set[int]:
    """Who may own a lease's directory: us, or the agent (kandev as root writes it for kandev-agent)."""
    try:
        return {os.geteuid(), agent_user().uid}
    except AgentUserMissing:
        return {os.geteuid()}


def write_lease_file(path: str | os.PathLike[str], lease_token: str, capability: str | None = None) -> Path:
    """Write (atomically, 0600) ``{"v": 1, "lease_token": ..., "capability": ...}``; the directory
    is created 0700 when missing."""
    p = Path(path)
    try:  # the directory may be the agent's (kandev as root writes the lease for kandev-agent)
        owners = {os.geteuid(), agent_user().uid}
    except AgentUserMissing:
        owners = {os.geteuid()}
    _ensure_private_dir(p.parent, owners)
    doc: dict[str, Any] = {"v": 1, "lease_token": lease_token}
    if capability:
        doc["capability"] = capability
    write_secret_file(p, (json.dumps(doc) + "\n").encode("ascii"))
    return p


class NoLease(ValueError):
    """The lease file says why the session has no lease (e.g. no upstream token is configured)."""


def write_no_lease_file(path: str | os.PathLike[str], reason: str) -> Path:
    """A lease file holding no lease, only ``reason`` (no secret): what git is told at a fetch or push."""
    p = Path(path)
    _ensure_private_dir(p.parent)
    write_secret_file(p, (json.dumps({"v": 1, "unavailable": reason}) + "\n").encode("utf-8"))
    return p


def read_lease_file(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``(lease_token, capability or None)``. The file must be a regular 0600 file of ours
    (``daemon.host.paths.SecretFileError`` otherwise); a file holding just the token is accepted."""
    text = read_secret_file(Path(path)).decode("utf-8", errors="replace").strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            raise ValueError(f"lease file {path} is not valid JSON") from None
        token = doc.get("lease_token") if isinstance(doc, dict) else None
        if isinstance(doc, dict) and not token and isinstance(doc.get("unavailable"), str):
            raise NoLease(doc["unavailable"])
        if not isinstance(token, str) or not token:
            raise ValueError(f"lease file {path} has no lease_token")
        cap = doc.get("capability")
        return token, cap if isinstance(cap, str) and cap else None
    first = text.splitlines()[0].strip() if text else ""
    if not first:
        raise ValueError(f"lease file {path} is empty")
    return first, None


# ---------------------------------------------------------------- the protocol


def _call(socket_path: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    from daemon.api.version import VERSION as API_VERSION
    from ipc.sync_client import SyncClient

    with SyncClient(socket_path, protocol_major=API_VERSION[0], timeout=TIMEOUT_S) as client:
        result = client.call(op, args, timeout=TIMEOUT_S)
    if not isinstance(result, dict):
        raise HelperError("internal", f"{op}: unexpected answer from the backend")
    return result


def valid_lease(lease_file: str, socket_path: str, host: str, path: str, *, protocol: str = "https") -> str:
    """The session's lease token, checked by its credential endpoint for ``host``/``path``
    (``credential_redeem``): if the endpoint answers that the lease is invalid, expired or revoked
    and the lease file holds a reissue capability, exactly one reissue (``credential_reissue``), the
    new lease written back to the file and checked once more (LEASE-CTX-3). Every other refusal is
    final: ``HelperError`` with the endpoint's code and message, never a secret. The answer holds
    no upstream credential: the token is used by kandev's git endpoint only (Issue 20)."""
    from ipc.errors import IpcError

    if host.strip().lower() == "" or not path:
        raise HelperError("invalid_argument", "no host or repository path")
    try:
        token, capability = read_lease_file(lease_file)
    except NoLease as exc:
        raise HelperError("credentials_unavailable", str(exc)) from None
    except (OSError, ValueError, PathsError) as exc:
        raise HelperError("lease_file", f"cannot read the lease file: {exc}") from None
    request = {"host": host, "path": path, "protocol": protocol}
    try:
        try:
            result = _call(socket_path, "credential_redeem", {"lease_token": token, **request})
        except IpcError as exc:
            if exc.code not in REISSUABLE_CODES or not capability:
                raise
            # The one reissue attempt (LEASE-CTX-3); whatever happens next is final.
            fresh = _call(socket_path, "credential_reissue", {"capability": capability})
            token = str(fresh["lease_token"])
            try:
                write_lease_file(lease_file, token, capability)
            except (OSError, PathsError):
                pass  # the new lease still works for this request; the next one reissues again
            result = _call(socket_path, "credential_redeem", {"lease_token": token, **request})
    except IpcError as exc:
        raise HelperError(exc.code, exc.message) from None
    if not isinstance(result.get("lease_id"), str):
        raise HelperError("internal", "the credential endpoint answered without a lease id")
    return token
