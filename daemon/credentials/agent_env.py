"""What an agent gets so that its ``git`` reaches its own repository through kandev (Issue 20).

The lease token (and the reissue capability) live in a 0600 **lease file**
(``<home>/sessions/<session id>/git/lease.json``, inside the agent's sandbox view): a per-session
credential, worthless anywhere but at that session's endpoints, revoked when the session ends.
The agent's environment names its path (``KANDEV_GIT_LEASE_FILE``) and the session's credential
endpoint (``KANDEV_BACKEND_SOCKET``); neither is a secret. ``agent_git_env`` adds git's
environment-borne configuration (``GIT_CONFIG_COUNT`` / ``GIT_CONFIG_KEY_n`` /
``GIT_CONFIG_VALUE_n``, read by git >= 2.31 as command-line configuration) so that:

- every ``https://github.com/``, ``git@github.com:`` and ``ssh://git@github.com/`` URL (and the
  same for the host of ``credentials.github_url`` when it is a GitHub Enterprise Server) is
  rewritten (``url.<ext>.insteadOf``) to an ``ext::`` command running ``daemon.git_transport``
  (by absolute interpreter path, isolated mode ``-I``), which carries git's protocol to the
  session's git endpoint (``endpoint/git-proxy.sock``, ``daemon.backend.git.endpoint``) where the
  upstream token is added, outside the sandbox;
- ``protocol.ext.allow`` is ``user``: ext URLs work for the agent's own commands, never for the
  URL of a submodule a repository names;
- no credential helper answers for those hosts (the helper list is reset): nothing in the sandbox
  hands out a credential, and no user-level helper (e.g. ``store``) is ever asked to keep one.

The agent can change its own git configuration; that only takes its git off kandev's endpoint
(then it holds no credential for GitHub at all). What may be reached is decided by the endpoint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

# The lease file's format belongs to the (deliberately light) helper that reads it.
from daemon.git_credential_helper import (
    LEASE_FILE_ENV,
    SOCKET_ENV,
    read_lease_file,
    write_lease_file,
    write_no_lease_file,
)
from daemon.host.paths import Paths
from daemon.host.session_dirs import SessionDirs

__all__ = ["LEASE_FILE_ENV", "SOCKET_ENV", "agent_git_env", "lease_file_path", "read_lease_file",
           "rewritten_hosts", "transport_command", "write_lease_file", "write_no_lease_file"]

TRANSPORT_MODULE = "daemon.git_transport"
GITHUB_URL = "https://github.com"
GITHUB_HOST = "github.com"
PROXY_SOCKET_NAME = "git-proxy.sock"


def _ext_word(text: str) -> str:
    """One word of an ``ext::`` command (git-remote-ext(1)): ``%`` and spaces escaped."""
    return text.replace("%", "%%").replace(" ", "% ")


def transport_command(proxy_socket: str | os.PathLike[str], credential_socket: str | os.PathLike[str],
                      lease_file: str | os.PathLike[str], host: str, python: str | None = None) -> str:
    """The ``ext::`` URL prefix a GitHub URL is rewritten to: git appends the repository path."""
    interpreter = os.path.abspath(python or sys.executable)
    words = [interpreter, "-I", "-m", TRANSPORT_MODULE, os.fspath(proxy_socket), os.fspath(credential_socket),
             os.fspath(lease_file), host]
    return "ext::" + " ".join(_ext_word(w) for w in words) + " %S "


def rewritten_hosts(github_url: str) -> list[str]:
    """The hosts whose URLs go through the session's git endpoint: github.com, and the host of
    ``credentials.github_url`` (GitHub Enterprise Server) when it is another."""
    hosts = [GITHUB_HOST]
    other = (urlsplit(github_url).hostname or "").lower()
    if other and other not in hosts:
        hosts.append(other)
    return hosts


def agent_git_env(
    lease_file: str | os.PathLike[str],
    socket: str | os.PathLike[str],
    *,
    base_env: Mapping[str, str] | None = None,
    python: str | None = None,
    github_url: str = GITHUB_URL,
    proxy_socket: str | os.PathLike[str] | None = None,
) -> dict[str, str]:
    """The variables to add to the agent's environment.

    ``socket``: the session's credential endpoint; ``proxy_socket``: its git endpoint (default
    ``git-proxy.sock`` beside ``socket``). ``base_env``: the environment they are added to; git
    configuration entries already in it (``GIT_CONFIG_COUNT``) are kept and ours are appended
    after them, so ours win.
    """
    base = base_env or {}
    try:
        start = int(base.get("GIT_CONFIG_COUNT", "0"))
    except ValueError:
        start = 0
    start = max(start, 0)
    proxy = proxy_socket if proxy_socket is not None else Path(socket).parent / PROXY_SOCKET_NAME
    entries: list[tuple[str, str]] = [("protocol.ext.allow", "user")]  # never for a submodule's URL
    for host in rewritten_hosts(github_url):
        # No credential helper answers for the host: nothing in the sandbox hands out a credential.
        entries.append((f"credential.https://{host}.helper", ""))
        ext = transport_command(proxy, socket, lease_file, host, python)
        for prefix in (f"https://{host}/", f"git@{host}:", f"ssh://git@{host}/"):
            entries.append((f"url.{ext}.insteadOf", prefix))
    env = {
        LEASE_FILE_ENV: os.fspath(lease_file),
        SOCKET_ENV: os.fspath(socket),
        "GIT_TERMINAL_PROMPT": "0",  # a refused request fails the git command instead of hanging on a prompt
        "GIT_CONFIG_COUNT": str(start + len(entries)),
    }
    for i, (key, value) in enumerate(entries, start=start):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def lease_file_path(paths: Paths, session_id: str) -> Path:
    """``<home>/sessions/<session id>/git/lease.json``: one lease file per session, replaced on resume."""
    return SessionDirs.for_session(paths.home, session_id).lease_file
