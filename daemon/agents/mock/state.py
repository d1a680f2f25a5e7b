"""Persistence and failure switches for the mock ACP agent.

A session is two files in the state dir:

``<session id>.json``
    ``{"session_id", "cwd", "mode", "config": {"model", "effort"}}``, replaced
    as a whole through a temporary file and ``os.replace`` whenever it
    changes, so no reader ever sees a half-written state.
``<session id>.history.jsonl``
    one line ``{"role": "user" | "agent", "text": ...}`` appended per chunk
    (one ``write`` with ``O_APPEND``). Rewriting a single JSON file per chunk
    is quadratic (``/flood 2000`` took ~5 s, ``/flood 10000`` ~2 min); the
    append keeps each chunk O(1). A torn last line is ignored on load.

``SessionRecord.messages()`` is what ``session/load`` replays: the history as messages (each run
of one role's chunks joined, at most ``REPLAY_MESSAGE_CHARS`` a message), the way real agents
replay a conversation, not one notification per streamed chunk. A long-lived session holds
hundreds of thousands of chunks (a /flood is thousands); replaying each as its own notification
kept a resume STARTING for tens of seconds (Issue 45 scenario A: ~8 s a session of 200,000
chunks, and every session of a killed control server is resumed at once).

The state dir is ``$KANDEV_MOCK_STATE_DIR`` when set, else
``<session cwd>/.kandev-mock/sessions/``.

Failure switches live in ``<workspace>/.kandev-mock.toml`` and are read anew
for every request, so a test can flip them between attempts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

STATE_DIR_ENV = "KANDEV_MOCK_STATE_DIR"
SWITCHES_FILE = ".kandev-mock.toml"

MODES = ("default", "plan")
CONFIG_VALUES: dict[str, tuple[str, ...]] = {
    "model": ("mock-fast", "mock-smart"),
    "effort": ("low", "medium", "high"),
}
DEFAULT_CONFIG = {"model": "mock-fast", "effort": "medium"}
REPLAY_MESSAGE_CHARS = 16_384
"""At most this many characters in one replayed message (a longer run of chunks is split)."""

_SESSION_ID = re.compile(r"^[0-9a-f]{32}$")
log = logging.getLogger("kandev.mock")


def state_dir(cwd: str) -> Path:
    """Directory holding the session files for a session whose cwd is ``cwd``."""
    override = os.environ.get(STATE_DIR_ENV)
    if override:
        return Path(override)
    return Path(cwd) / ".kandev-mock" / "sessions"


def read_switches(workspace: str | os.PathLike[str]) -> dict[str, Any]:
    """Failure switches from ``<workspace>/.kandev-mock.toml`` ({} if absent or invalid)."""
    path = Path(workspace) / SWITCHES_FILE
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}


@dataclass
class HistoryEntry:
    role: Literal["user", "agent"]
    text: str


@dataclass
class SessionRecord:
    session_id: str
    cwd: str
    mode: str = "default"
    config: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_CONFIG))
    history: list[HistoryEntry] = field(default_factory=list)

    @property
    def path(self) -> Path:
        """The session's state file."""
        return state_dir(self.cwd) / f"{self.session_id}.json"

    @property
    def history_path(self) -> Path:
        return state_dir(self.cwd) / f"{self.session_id}.history.jsonl"

    def append(self, role: Literal["user", "agent"], text: str) -> None:
        """Record one chunk and persist it before returning."""
        entry = HistoryEntry(role, text)
        line = (json.dumps(asdict(entry), separators=(",", ":")) + "\n").encode()
        fd = os.open(self.history_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self.history.append(entry)

    def messages(self, max_chars: int = REPLAY_MESSAGE_CHARS) -> list[HistoryEntry]:
        """The history as messages: consecutive chunks of one role joined, in order, each message
        at most ``max_chars`` long (a longer run is split, never a chunk; a single chunk longer
        than that is a message of its own)."""
        out: list[HistoryEntry] = []
        role: Literal["user", "agent"] | None = None
        parts: list[str] = []
        size = 0
        for entry in self.history:
            if parts and (entry.role != role or size + len(entry.text) > max_chars):
                out.append(HistoryEntry(role or entry.role, "".join(parts)))
                parts, size = [], 0
            role = entry.role
            parts.append(entry.text)
            size += len(entry.text)
        if parts and role is not None:
            out.append(HistoryEntry(role, "".join(parts)))
        return out

    def save(self) -> None:
        """Atomically replace the state file (everything but the history)."""
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"session_id": self.session_id, "cwd": self.cwd, "mode": self.mode, "config": self.config}
        fd, tmp = tempfile.mkstemp(prefix=f".{self.session_id}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(state, fh, separators=(",", ":"))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, session_id: str, cwd: str) -> SessionRecord | None:
        """The persisted session, or None if there is no such session."""
        if not _SESSION_ID.match(session_id):
            return None
        try:
            state = json.loads((state_dir(cwd) / f"{session_id}.json").read_text())
        except FileNotFoundError:
            return None
        rec = cls(
            session_id=session_id,
            cwd=cwd,
            mode=state.get("mode", "default"),
            config={**DEFAULT_CONFIG, **state.get("config", {})},
        )
        try:
            lines = rec.history_path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                raw = json.loads(line)
            except json.JSONDecodeError:
                log.warning("skipping torn history line in %s", rec.history_path)
                continue
            rec.history.append(HistoryEntry(raw["role"], raw["text"]))
        return rec
