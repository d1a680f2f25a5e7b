"""Handing a workspace to the agents, as a user would: when the tests run kandev as root, agents
run as ``kandev-agent`` (daemon/host/agent_user.py) and kandev refuses a workspace that user cannot
write, so a test gives what it hands over to that user (``chown -R``, the fix kandev's refusal
names). Unprivileged (the systemd tests' ``kandev`` user), agents keep our uid: nothing to do."""

from __future__ import annotations

import os
from pathlib import Path

from daemon.host.agent_user import agent_user


def for_agent(path: Path) -> Path:
    """``chown -R`` ``path`` to the uid agents run as (never following a symlink); returns it."""
    user = agent_user()
    if not user.dedicated:
        return path
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(root, name), user.uid, user.gid, follow_symlinks=False)
    return path

