"""``task_sessions.metadata_json`` through named fields instead of free dict edits.

What the backend keeps about a session besides its state, one JSON object:

- ``acp.session_id``: the provider conversation's token (``resume`` continues it; only ``--fresh``
  wipes it and only a new provider session replaces it);
- ``runtime_config`` and ``acp_catalogue``: the session's model, mode and options as the agent
  accepted or reported them, and what the agent announced it offers
  (``daemon.backend.sessions.runtime_config``);
- ``resume`` and ``context_reset``: the status record of the last resume and context reset;
- ``git_credential_snapshot``: the non-secret record of the session's git credentials
  (``daemon.credentials.broker``);
- ``runtime_prepare``: the runtime job a first use of a managed npm agent ran before its agent
  started (``daemon.backend.sessions.runtime_prepare``).

``SessionMetadata.load`` copies the stored object (keys this module does not name are kept as
they are), the named operations change the copy, and ``save`` (or handing ``to_json()`` to
``transitions.transition_session``) writes it back whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from daemon.store.models import TaskSession

ACP = "acp"
RUNTIME_CONFIG = "runtime_config"
ACP_CATALOGUE = "acp_catalogue"
RESUME = "resume"
CONTEXT_RESET = "context_reset"
GIT_CREDENTIAL_SNAPSHOT = "git_credential_snapshot"
RUNTIME_PREPARE = "runtime_prepare"


@dataclass
class SessionMetadata:
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, session: TaskSession) -> SessionMetadata:
        return cls(dict(session.metadata_json or {}))

    @classmethod
    def new(cls) -> SessionMetadata:
        """A new session's: no token yet, nothing configured."""
        return cls({RUNTIME_CONFIG: {"model": None, "mode": None, "options": {}}})

    def to_json(self) -> dict[str, Any]:
        return dict(self.data)

    def save(self, session: TaskSession) -> None:
        session.metadata_json = self.to_json()

    # -- the provider conversation's token
    @property
    def acp_session_id(self) -> str | None:
        return (self.data.get(ACP) or {}).get("session_id")

    def set_acp_session_id(self, token: str | None) -> None:
        self.data[ACP] = {**(self.data.get(ACP) or {}), "session_id": token}

    # -- runtime configuration
    @property
    def runtime_config(self) -> Any:
        """The stored value as JSON (``SessionRuntimeConfig.from_json`` reads it), or None."""
        return self.data.get(RUNTIME_CONFIG)

    def runtime_config_or_empty(self) -> dict[str, Any]:
        return self.data.get(RUNTIME_CONFIG) or {"model": None, "mode": None, "options": {}}

    def set_runtime_config(self, value: dict[str, Any]) -> None:
        self.data[RUNTIME_CONFIG] = value

    @property
    def acp_catalogue(self) -> Any:
        return self.data.get(ACP_CATALOGUE)

    def set_acp_catalogue(self, value: dict[str, Any]) -> None:
        self.data[ACP_CATALOGUE] = value

    # -- status records of the last resume and context reset
    def set_resume(self, **record: Any) -> None:
        """Replace the resume record."""
        self.data[RESUME] = record

    def set_context_reset(self, **record: Any) -> None:
        """Replace the context-reset record."""
        self.data[CONTEXT_RESET] = record

    def update_context_reset(self, **fields: Any) -> None:
        """Change some fields of the context-reset record, keeping the others."""
        self.data[CONTEXT_RESET] = {**(self.data.get(CONTEXT_RESET) or {}), **fields}

    # -- git credentials
    @property
    def git_credential_snapshot(self) -> dict[str, Any]:
        return self.data.get(GIT_CREDENTIAL_SNAPSHOT) or {}

    def set_git_credential_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.data[GIT_CREDENTIAL_SNAPSHOT] = snapshot

    # -- the runtime job of a first use
    @property
    def runtime_prepare(self) -> dict[str, Any] | None:
        return self.data.get(RUNTIME_PREPARE)

    def set_runtime_prepare(self, progress: dict[str, Any]) -> None:
        self.data[RUNTIME_PREPARE] = progress
