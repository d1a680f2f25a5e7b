"""The launch file: everything a control-server launch needs, written by whoever starts it.

The backend (or a test) writes one JSON object, mode 0600, and starts
``kandev-agentctl --launch-file PATH`` (default ``<home>/agentctl/launch.json``)::

    {"socket_path": ..., "log_path": ..., "agent_log_dir": ...,
     "installation_id": ..., "credential_file": PATH | null,
     "detached_event_limit": 100, "unowned_period_s": 600, "idle_timeout_s": 3600,
     "mode": "unit" | "detached" | "child",
     "agent_secret_env": {"claude-code": {"ANTHROPIC_API_KEY": "/etc/kandev/secrets/key"}}}

``agent_secret_env`` holds the *references* of each agent's ``secret_env`` (file paths or
``credential:NAME``, never a value; ``daemon.agents.settings``): ``validate`` reads each one once,
so a server that could not serve its configured keys refuses to start naming the key, and no
agent's sandbox shows those files (``daemon.agentctl.sandbox.agent_env``).

The numbers are handed over as given and checked by ``validate`` (which uses
``daemon.config.agentctl.validate_agentctl``) when the server starts: out of range is a
refusal, never a clamp (AC-EXECUTORS-SURVIVAL-001.8). The log path is computed
by the starter (AC-EXECUTORS-SURVIVAL-001.3).

The credential is not in the launch file. Under systemd it is read from
``$CREDENTIALS_DIRECTORY/agentctl-credential`` (``LoadCredential=``); otherwise
from ``credential_file``, which must be a regular 0600 file of ours (no
symlink). A credential file holds the 32 credential bytes as 64 hex digits
and a newline (``write_credential`` / ``read_credential_file``).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from daemon.agentctl.auth import CREDENTIAL_BYTES
from daemon.agentctl.sandbox import agent_env
from daemon.agents.settings import SecretRef, SettingsError
from daemon.config.agentctl import ResolvedAgentctl, validate_agentctl
from daemon.config.keys import ConfigError
from daemon.host.paths import Paths, SecretFileError, read_secret_file, write_secret_file
from daemon.store.states import LaunchMode

CREDENTIAL_NAME = "agentctl-credential"
"""Name of the credential under ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=agentctl-credential:...``)."""

LAUNCH_FILE_NAME = "launch.json"

_REQUIRED_STR = ("socket_path", "log_path", "agent_log_dir", "installation_id")
_MAX_LAUNCH_FILE = 64 * 1024


class LaunchError(Exception):
    """The launch file or the credential cannot be used; the server refuses to start."""


Number = int | float | str


@dataclass(frozen=True)
class LaunchConfig:
    """One launch of the control server. Numbers are raw until ``validate``."""

    socket_path: str
    log_path: str
    agent_log_dir: str
    installation_id: str
    credential_file: str | None = None
    detached_event_limit: Number = 100
    unowned_period_s: Number = 600.0
    idle_timeout_s: Number = 3600.0
    mode: LaunchMode = LaunchMode.CHILD  # how the server was started (its wire value in the file)
    agent_secret_env: dict[str, dict[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def secret_refs(self) -> dict[str, dict[str, SecretRef]]:
        """``agent_secret_env`` parsed (``from_json`` checked it already)."""
        return {name: agent_env.parse_refs(refs, f"agents.{name}.secret_env")
                for name, refs in self.agent_secret_env.items()}

    def own_paths(self, env: Mapping[str, str] | None = None) -> list[str]:
        """What of this server no agent may see or name as a secret file: its socket directory, its
        logs (agents' stderr included), its credential's directory and systemd credentials."""
        environ = os.environ if env is None else env
        paths = [os.path.dirname(self.socket_path), os.path.dirname(self.log_path), self.agent_log_dir]
        if self.credential_file:
            paths.append(os.path.dirname(self.credential_file))
        if environ.get("CREDENTIALS_DIRECTORY"):
            paths.append(environ["CREDENTIALS_DIRECTORY"])
        return [p for p in paths if p and os.path.isabs(p)]


def default_launch_file(home: str | os.PathLike[str]) -> Path:
    """``<home>/agentctl/launch.json``."""
    return Paths.for_home(Path(home)).agentctl_dir / LAUNCH_FILE_NAME


def from_json(doc: Any) -> LaunchConfig:
    """Build a ``LaunchConfig`` from a decoded JSON object; structural checks only."""
    if not isinstance(doc, dict):
        raise LaunchError("the launch file must hold one JSON object")
    values: dict[str, Any] = {}
    for key in _REQUIRED_STR:
        value = doc.get(key)
        if not isinstance(value, str) or not value:
            raise LaunchError(f"launch file: '{key}' must be a non-empty string (got {value!r:.100})")
        values[key] = value
    cred = doc.get("credential_file")
    if cred is not None and (not isinstance(cred, str) or not cred):
        raise LaunchError(f"launch file: 'credential_file' must be a path or null (got {cred!r:.100})")
    values["credential_file"] = cred
    mode = doc.get("mode", LaunchMode.CHILD)
    if not isinstance(mode, str) or mode not in tuple(LaunchMode):
        raise LaunchError(f"launch file: 'mode' must be one of {', '.join(LaunchMode)} (got {mode!r:.100})")
    values["mode"] = LaunchMode(mode)
    for key in ("detached_event_limit", "unowned_period_s", "idle_timeout_s"):
        if key in doc:
            value = doc[key]
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise LaunchError(f"launch file: '{key}' must be a number (got {value!r:.100})")
            values[key] = value
    secrets = doc.get("agent_secret_env", {})
    if not isinstance(secrets, dict) or not all(isinstance(n, str) and n for n in secrets):
        raise LaunchError("launch file: 'agent_secret_env' must map agent names to {VARIABLE: reference}")
    try:
        for name, refs in secrets.items():
            agent_env.parse_refs(refs, f"agents.{name}.secret_env")
    except SettingsError as exc:
        raise LaunchError(f"launch file: agent_secret_env: {exc}") from None
    values["agent_secret_env"] = {n: dict(r) for n, r in secrets.items()}
    return LaunchConfig(**values)


def load(path: str | os.PathLike[str]) -> LaunchConfig:
    """Read and structurally check a launch file (a 0600 regular file of ours, no symlink)."""
    p = Path(path)
    try:
        raw = read_secret_file(p)
    except SecretFileError as exc:
        raise LaunchError(f"launch file {exc}") from None
    except OSError as exc:
        raise LaunchError(f"launch file {p}: {exc.strerror or exc}") from None
    if len(raw) > _MAX_LAUNCH_FILE:
        raise LaunchError(f"launch file {p} is larger than {_MAX_LAUNCH_FILE} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LaunchError(f"launch file {p} is not valid JSON: {exc}") from None
    return from_json(doc)


def dump(config: LaunchConfig, path: str | os.PathLike[str]) -> None:
    """Write ``config`` to ``path`` as a 0600 file, atomically (the directory must exist)."""
    data = json.dumps(config.to_json(), indent=2, sort_keys=True).encode("utf-8") + b"\n"
    write_secret_file(Path(path), data)


def validate(config: LaunchConfig, *, check_secrets: bool = True) -> ResolvedAgentctl:
    """Check the numeric settings and (``check_secrets``) that every agent's secret can be read;
    raises ``daemon.config.keys.ConfigError`` naming the key (value and range for numbers; never a
    secret). A re-exec does not check the secrets: its running agents have theirs already, and a
    key gone meanwhile fails only a later start of that agent, never the reload."""
    resolved = validate_agentctl(
        config.detached_event_limit,
        config.unowned_period_s,
        config.idle_timeout_s,
    )
    if not check_secrets:
        return resolved
    try:
        agent_env.check_all(config.secret_refs(), credentials_dir=os.environ.get("CREDENTIALS_DIRECTORY"),
                            forbidden=config.own_paths())
    except agent_env.SecretUnavailable as exc:
        raise ConfigError(str(exc), key=str(exc).split(" ", 1)[0]) from None
    return resolved


# ---------------------------------------------------------------- credential


def encode_credential(credential: bytes) -> bytes:
    """The file form of a credential: hex digits and a newline."""
    if len(credential) != CREDENTIAL_BYTES:
        raise ValueError(f"a credential is {CREDENTIAL_BYTES} bytes, not {len(credential)}")
    return credential.hex().encode("ascii") + b"\n"


def decode_credential(data: bytes, where: str) -> bytes:
    """Parse the file form; raises ``LaunchError`` naming ``where`` (never the content)."""
    try:
        credential = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise LaunchError(f"credential {where} is malformed (expected {CREDENTIAL_BYTES * 2} hex digits)") from None
    if len(credential) != CREDENTIAL_BYTES:
        raise LaunchError(f"credential {where} is malformed (expected {CREDENTIAL_BYTES * 2} hex digits)")
    return credential


def write_credential(path: str | os.PathLike[str], credential: bytes) -> None:
    """Write a credential file (0600, atomic)."""
    write_secret_file(Path(path), encode_credential(credential))


def read_credential_file(path: str | os.PathLike[str]) -> bytes:
    """Read a credential file written by ``write_credential``; refuses symlinks and modes but 0600."""
    p = Path(path)
    try:
        return decode_credential(read_secret_file(p), str(p))
    except SecretFileError as exc:
        raise LaunchError(f"credential file {exc}") from None
    except OSError as exc:
        raise LaunchError(f"credential file {p}: {exc.strerror or exc}") from None


def _read_systemd_credential(directory: str) -> bytes | None:
    """``$CREDENTIALS_DIRECTORY/agentctl-credential``, or None if systemd passed none of that name.

    systemd makes these files read-only for the service user (0400 or 0440 on
    a private, non-swappable mount), so only symlinks and non-regular files
    are refused here.
    """
    path = Path(directory) / CREDENTIAL_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LaunchError(f"credential {path}: {exc.strerror or exc} (a symlink is refused)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LaunchError(f"credential {path} is not a regular file")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return decode_credential(data, str(path))


def read_credential(config: LaunchConfig, env: Mapping[str, str] | None = None) -> bytes:
    """The credential this launch proves and authenticates with.

    ``$CREDENTIALS_DIRECTORY/agentctl-credential`` when systemd passed it, else
    ``config.credential_file``. Raises ``LaunchError`` when neither is usable.
    """
    environ = os.environ if env is None else env
    directory = environ.get("CREDENTIALS_DIRECTORY")
    if directory:
        credential = _read_systemd_credential(directory)
        if credential is not None:
            return credential
    if config.credential_file is None:
        raise LaunchError(
            "no credential: the launch file names no credential_file and systemd passed no"
            f" '{CREDENTIAL_NAME}' credential"
        )
    return read_credential_file(config.credential_file)
