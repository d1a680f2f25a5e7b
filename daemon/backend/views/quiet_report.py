"""What ``follow``, the board and ``session show`` say about a turn whose agent is silent.

``daemon.backend.state.quiet_turns`` measures the silence; this module turns one ``Quiet`` into the
``quiet`` object those answers carry (Issue 46 Why 5)::

    {"turn_id", "seconds", "timed_out", "logs": "kandev logs SID", "cancel": "kandev cancel SID",
     "provider": "ANTHROPIC_BASE_URL=https://..." | None}

``provider`` is the address of the agent's provider as kandev gave it to the agent: the first
variable of its ``[agents.NAME] env`` whose name says it is an address (``*_BASE_URL``, ``*_URL``,
``*_ENDPOINT``, ``*_HOST``), without any user, password, query or fragment the value holds; None when
the agent was given none (it uses its own default). The CLI words it (``daemon.cli.human``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from daemon.agents.settings import AgentSettings
from daemon.backend.state.quiet_turns import Quiet

ADDRESS_VARIABLE = re.compile(r"(^|_)(BASE_URL|URL|ENDPOINT|HOST|API_BASE)$")
"""Names of the environment variables that hold a provider's address."""
SHORT_ID = 8
QuietOf = Callable[[str, "str | None"], "dict[str, Any] | None"]
"""(session id, its agent's name) -> the session's ``quiet`` object, or None (``BackendContext.quiet_report``)."""


def provider_address(settings: AgentSettings | None) -> str | None:
    """``NAME=address`` of the agent's configured provider address, or None (see the module doc)."""
    if settings is None:
        return None
    for name in sorted(settings.env):
        if ADDRESS_VARIABLE.search(name):
            return f"{name}={_without_secrets(settings.env[name])}"
    return None


def _without_secrets(value: str) -> str:
    """The address without user, password, query and fragment (a URL may carry a key in them)."""
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError:
        return "(not an address)"
    if not parts.scheme or host is None:
        return value.split("@")[-1].split("?")[0]
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def quiet_report(quiet: Quiet | None, session_id: str, agent: str | None,
                 settings: Mapping[str, AgentSettings]) -> dict[str, Any] | None:
    """The ``quiet`` object of a session's answers, or None while its agent is not silent."""
    if quiet is None:
        return None
    sid = session_id[:SHORT_ID]
    return {
        "turn_id": quiet.turn_id,
        "seconds": quiet.seconds,
        "timed_out": quiet.timed_out,
        "logs": f"kandev logs {sid}",
        "cancel": f"kandev cancel {sid}",
        "provider": provider_address(settings.get(agent) if agent else None),
    }
