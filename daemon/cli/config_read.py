"""Which configuration ``kandev agents`` and ``kandev doctor`` describe, and how they say so.

The running backend's: asked over its socket (``config_show``: the file it was started with and
the ``KANDEV_*`` variables of its environment, as it parsed them, its key files checked as its
user), unless ``--config FILE`` names another file. When no backend answers (none runs for this
home, this user may not reach it, or it predates ``config_show``), the file ``kandev up`` would
start one with (``$KANDEV_CONFIG``, else /etc/kandev/kandev.toml), read by this command. Either
way the answer is a view (``daemon.config.view``) with ``read_by`` (``backend`` or ``this
command``) and ``reason``: why that one, in words, for the line that names the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daemon.cli.call import call
from ipc.errors import IpcError

BACKEND = "backend"
HERE = "this command"


def backend_config(socket: str | Path) -> dict[str, Any] | None:
    """The running backend's configuration view, or None when no backend answers it."""
    try:
        view: dict[str, Any] = call(socket, "config_show", timeout=10.0)
    except (IpcError, OSError):
        return None
    return view


def described(view: dict[str, Any], read_by: str, reason: str) -> dict[str, Any]:
    return {**view, "read_by": read_by, "reason": reason}


def local_view(config_path: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The file this command would start a backend with, parsed here (``error``: why it is
    refused; then the view holds the defaults and names the file it could not use)."""
    from daemon.config.keys import ConfigError
    from daemon.config.settings import Config, config_file, load_config
    from daemon.config.view import config_view

    reason = ("--config" if config_path else
              "no backend answers for this home: the file `kandev up` would start one with")
    try:
        view = config_view(load_config(config_path, os.environ if env is None else env))
    except ConfigError as exc:
        view = {**config_view(Config()), "file": config_file(config_path, env), "error": str(exc)}
    return described(view, HERE, reason)


def read_config(socket: str | Path, config_path: str | None) -> dict[str, Any]:
    """The running backend's configuration, unless ``config_path`` names a file (see the module)."""
    if config_path is None:
        view = backend_config(socket)
        if view is not None:
            return described(view, BACKEND, f"the running backend's, pid {view.get('pid')}, as it read it at"
                             " its start")
    return local_view(config_path)
