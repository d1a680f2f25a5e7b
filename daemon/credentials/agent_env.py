"""What an agent gets so that its ``git`` authenticates to github.com through the broker.

The lease token (and the reissue capability) live in a 0600 **lease file**
(``<home>/sessions/<session id>/git/lease.json``, inside the agent's sandbox view); the agent's
environment names only its path (``KANDEV_GIT_LEASE_FILE``) and the socket that redeems it
(``KANDEV_BACKEND_SOCKET``): for agents the backend launches, the session's own credential
endpoint (``daemon.backend.credential_endpoints``), which serves that session's lease and nothing
else; neither is a secret. ``agent_git_env`` adds git's
environment-borne configuration (``GIT_CONFIG_COUNT`` / ``GIT_CONFIG_KEY_n`` /
``GIT_CONFIG_VALUE_n``, read by git >= 2.31 as command-line configuration) so that for
``https://github.com`` git's credential helper list is reset (no system or user helper, e.g.
``store``, ever sees the upstream token) and then holds only the shipped helper, run by absolute
interpreter path in isolated mode (``-I``: the repository's cwd cannot shadow the module), and
so that git passes the repository path to it (``useHttpPath``).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

# The lease file's format belongs to the (deliberately light) helper that reads it.
from daemon.git_credential_helper import LEASE_FILE_ENV, SOCKET_ENV, read_lease_file, write_lease_file
from daemon.paths import Paths
from daemon.session_dirs import SessionDirs

__all__ = ["LEASE_FILE_ENV", "SOCKET_ENV", "agent_git_env", "helper_command", "lease_file_path",
           "read_lease_file", "write_lease_file"]

HELPER_MODULE = "daemon.git_credential_helper"
GITHUB_URL = "https://github.com"


def helper_command(python: str | None = None) -> str:
    """The ``credential.helper`` value: ``!<python> -I -m daemon.git_credential_helper``."""
    interpreter = os.path.abspath(python or sys.executable)
    return f"!{shlex.quote(interpreter)} -I -m {HELPER_MODULE}"


def agent_git_env(
    lease_file: str | os.PathLike[str],
    socket: str | os.PathLike[str],
    *,
    base_env: Mapping[str, str] | None = None,
    python: str | None = None,
) -> dict[str, str]:
    """The variables to add to the agent's environment.

    ``base_env``: the environment they are added to; git configuration entries already in it
    (``GIT_CONFIG_COUNT``) are kept and ours are appended after them, so ours win.
    """
    base = base_env or {}
    try:
        start = int(base.get("GIT_CONFIG_COUNT", "0"))
    except ValueError:
        start = 0
    start = max(start, 0)
    entries = [
        (f"credential.{GITHUB_URL}.helper", ""),  # an empty value clears the helpers configured so far
        (f"credential.{GITHUB_URL}.helper", helper_command(python)),
        (f"credential.{GITHUB_URL}.useHttpPath", "true"),
    ]
    env = {
        LEASE_FILE_ENV: os.fspath(lease_file),
        SOCKET_ENV: os.fspath(socket),
        "GIT_TERMINAL_PROMPT": "0",  # a refused lease fails the git command instead of hanging on a prompt
        "GIT_CONFIG_COUNT": str(start + len(entries)),
    }
    for i, (key, value) in enumerate(entries, start=start):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def lease_file_path(paths: Paths, session_id: str) -> Path:
    """``<home>/sessions/<session id>/git/lease.json``: one lease file per session, replaced on resume."""
    return SessionDirs.for_session(paths.home, session_id).lease_file
