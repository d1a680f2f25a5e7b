"""``kandev-git-credential``: the git credential helper kandev ships for its agents.

git runs it as ``<helper> get|store|erase`` with the credential request on stdin (``key=value``
lines, then a blank line or end of input; see gitcredentials(7)). For ``get`` on
``protocol=https`` and ``host=github.com`` it reads the agent's lease from the 0600 file named by
``$KANDEV_GIT_LEASE_FILE``, asks the backend at ``$KANDEV_BACKEND_SOCKET`` to redeem it
(``credential_redeem``; the socket admits peers by ``SO_PEERCRED``) and prints::

    username=x-access-token
    password=<the upstream token>

If the backend answers that the lease is invalid, expired or revoked and the lease file holds a
reissue capability, it makes exactly one reissue attempt (``credential_reissue``), writes the new
lease back to the file and redeems once more (LEASE-CTX-3). Every other refusal is final: it
prints ``quit=1`` (so git asks nobody else) and exits 1 with the reason on stderr, never a token.
Any other host or protocol gets an empty answer. ``store`` and ``erase`` are no-ops: the upstream
token is never written anywhere.

The lease token and the capability never appear in the environment, in argv or on stderr. This
module also owns the lease file's format (``read_lease_file`` / ``write_lease_file``) and stays
light (no database code), since git starts it for every credential request.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from daemon.paths import PathsError, read_secret_file, write_secret_file

LEASE_FILE_ENV = "KANDEV_GIT_LEASE_FILE"
SOCKET_ENV = "KANDEV_BACKEND_SOCKET"
GITHUB_HOST = "github.com"
# The broker's lease failures after which one reissue is tried (daemon.credentials.errors).
REISSUABLE_CODES = frozenset({"lease_invalid", "lease_expired", "lease_revoked"})
TIMEOUT_S = 15.0
_MAX_INPUT = 64 * 1024


class HelperError(Exception):
    """A final refusal, with a stable ``code``; its message never holds a secret."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# ---------------------------------------------------------------- the lease file


def _ensure_private_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{path} is not a directory owned by us; refusing to put a lease file in it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def write_lease_file(path: str | os.PathLike[str], lease_token: str, capability: str | None = None) -> Path:
    """Write (atomically, 0600) ``{"v": 1, "lease_token": ..., "capability": ...}``; the directory
    is created 0700 when missing."""
    p = Path(path)
    _ensure_private_dir(p.parent)
    doc: dict[str, Any] = {"v": 1, "lease_token": lease_token}
    if capability:
        doc["capability"] = capability
    write_secret_file(p, (json.dumps(doc) + "\n").encode("ascii"))
    return p


def read_lease_file(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``(lease_token, capability or None)``. The file must be a regular 0600 file of ours
    (``daemon.paths.SecretFileError`` otherwise); a file holding just the token is accepted."""
    text = read_secret_file(Path(path)).decode("utf-8", errors="replace").strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            raise ValueError(f"lease file {path} is not valid JSON") from None
        token = doc.get("lease_token") if isinstance(doc, dict) else None
        if not isinstance(token, str) or not token:
            raise ValueError(f"lease file {path} has no lease_token")
        cap = doc.get("capability")
        return token, cap if isinstance(cap, str) and cap else None
    first = text.splitlines()[0].strip() if text else ""
    if not first:
        raise ValueError(f"lease file {path} is empty")
    return first, None


# ---------------------------------------------------------------- the protocol


def parse_request(stream: IO[str]) -> dict[str, str]:
    """git's ``key=value`` lines up to a blank line or end of input (array keys keep the last)."""
    attrs: dict[str, str] = {}
    total = 0
    for line in stream:
        total += len(line)
        if total > _MAX_INPUT:
            raise HelperError("invalid_argument", "credential request too large")
        line = line.rstrip("\n")
        if not line:
            break
        key, sep, value = line.partition("=")
        if sep:
            attrs[key] = value
    return attrs


def _call(socket_path: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    from daemon.backend import api
    from ipc.sync_client import SyncClient

    with SyncClient(socket_path, protocol_major=api.VERSION[0], timeout=TIMEOUT_S) as client:
        result = client.call(op, args, timeout=TIMEOUT_S)
    if not isinstance(result, dict):
        raise HelperError("internal", f"{op}: unexpected answer from the backend")
    return result


def fill(attrs: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """The answer to ``get``: ``{}`` when the request is not ours, else username and password."""
    from ipc.errors import IpcError

    if attrs.get("protocol", "").lower() != "https" or attrs.get("host", "").lower() != GITHUB_HOST:
        return {}
    lease_file, socket_path = env.get(LEASE_FILE_ENV), env.get(SOCKET_ENV)
    if not lease_file or not socket_path:
        raise HelperError("not_configured", f"${LEASE_FILE_ENV} and ${SOCKET_ENV} must both be set")
    path = attrs.get("path", "")
    if not path:
        raise HelperError("invalid_argument", "git sent no repository path (set credential.useHttpPath=true)")
    try:
        token, capability = read_lease_file(lease_file)
    except (OSError, ValueError, PathsError) as exc:
        raise HelperError("lease_file", f"cannot read the lease file: {exc}") from None
    request = {"host": attrs["host"], "path": path, "protocol": attrs["protocol"]}
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
    username, password = result.get("username"), result.get("password")
    if not isinstance(username, str) or not isinstance(password, str) or not password:
        raise HelperError("internal", "the backend answered without a credential")
    return {"username": username, "password": password}


def main(argv: list[str] | None = None, *, stdin: IO[str] | None = None, stdout: IO[str] | None = None,
         stderr: IO[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    inp, out, err = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    action = args[0] if args else ""
    if action != "get":
        # store / erase: never keep the upstream token; unknown actions are ignored (gitcredentials(7)).
        for _ in inp:
            pass
        return 0
    try:
        answer = fill(parse_request(inp), os.environ if env is None else env)
    except HelperError as exc:
        print(f"kandev-git-credential: {exc.code}: {exc.message}", file=err)
        out.write("quit=1\n")
        out.flush()
        return 1
    except Exception as exc:  # fail closed, without a traceback that could quote a request
        print(f"kandev-git-credential: internal: {type(exc).__name__}", file=err)
        out.write("quit=1\n")
        out.flush()
        return 1
    for key, value in answer.items():
        if "\n" in value or "\0" in value:
            print("kandev-git-credential: internal: unusable credential", file=err)
            return 1
        out.write(f"{key}={value}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
