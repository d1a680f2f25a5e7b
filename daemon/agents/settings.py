"""Per-agent settings and provider keys: ``[agents.NAME]`` in the configuration.

::

    [agents.claude-code]
    env = { ANTHROPIC_BASE_URL = "https://api.anthropic.com", ANTHROPIC_MODEL = "claude-sonnet-4-5" }
    secret_env = { ANTHROPIC_API_KEY = "/etc/kandev/secrets/anthropic-api-key" }
    home_files = { ".config/opencode/opencode.json" = "/etc/kandev/agents/opencode.json" }

- ``env``: plain settings, put in that agent's environment as they are (they are not secret: the
  backend hands them to the control server with the launch, and ``kandev agents`` shows their
  names).
- ``secret_env``: a variable -> where its value lives, either an absolute path of a file (mode 0600
  or 0640, also 0400/0440; owned by root or the service user; a group-readable file belongs to group
  root or the service group; no symlink) or ``credential:NAME``, a systemd credential the control
  server's unit loads (``LoadCredential=NAME:/path`` in a drop-in), read from
  ``$CREDENTIALS_DIRECTORY/NAME``. Only the *reference* ever travels (configuration, launch file,
  ``create_instance``); the control server reads the value itself when it spawns that agent and
  puts it in that agent's environment only (``daemon.agentctl.sandbox.agent_env``). A value is never
  logged, stored, shown, nor in any argv.
- ``max_memory``: that agent's memory bound (``daemon.agents.memory``: bytes or ``"2G"``, 64 MiB to
  the host's RAM), instead of ``agents.max_memory``.
- ``network`` and ``allow_hosts``: the agent's network mode (else ``[network] mode``) and the hosts
  it may reach besides its built-in ones (``daemon.agents.network``).
- ``home_files``: a path relative to the session's HOME -> an absolute host file, copied into that
  HOME before every launch of the agent (``daemon.agents.home_files``): an agent's own
  configuration file (its provider's address, its update and telemetry switches). The file is
  checked like a secret file (it may name a key) and copied mode 0600; ``kandev agents`` shows
  destinations and sources, never contents. A key belongs in ``secret_env``, which the file can
  name (e.g. OpenCode's ``{env:ANTHROPIC_API_KEY}``, Codex's ``env_key``).

Built-in defaults (``BuiltinAgent.default_env``, e.g. Claude Code's ``DISABLE_TELEMETRY=1``) come
first; ``env`` overrides them. Variables kandev sets itself (``HOME``, ``PATH``, ``KANDEV_*``, the
git credential routing ``GIT_*``) cannot be set here, and one name cannot be both plain and secret.

Checks (``SettingsError`` naming the dotted key, e.g. ``agents.claude-code.secret_env.X``): an
unknown agent, a bad variable name, a non-string value, a relative path. The files themselves
(presence, type, owner, mode, emptiness) are checked by ``daemon.agents.file_checks`` (``kandev up``,
the backend at start, ``kandev doctor``) and by the control server at its start and at every spawn,
where it reads the value (``check_secret_stat``, here: a ``KeyFileError`` says what to do).
"""

from __future__ import annotations

import enum
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from daemon.agents import memory
from daemon.agents.network import RuleError, check_mode, parse_rules
from daemon.agents.registry import BUILTIN_AGENTS

CREDENTIAL_PREFIX = "credential:"
RESERVED_CREDENTIALS = frozenset({"agentctl-credential"})  # the control server's own (daemon.agentctl.launch)
SECRET_MAX_BYTES = 64 * 1024
ALLOWED_MODES = (0o600, 0o640, 0o400, 0o440)
SERVICE_GROUP = "kandev"
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CREDENTIAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
RESERVED_VARS = frozenset({"HOME", "PATH", "USER", "LOGNAME", "PWD", "SHELL"})
AGENT_PATH = "/usr/local/bin:/usr/bin:/bin"
"""An agent's ``PATH`` unless its configuration says otherwise: the system's directories only
(the control server sets it; the backend puts a runtime's own directory first)."""
RESERVED_PREFIXES = ("KANDEV_", "GIT_")
MAX_VARS = 64
MAX_VALUE = 8192
MAX_HOME_FILES = 32
MAX_HOME_PATH = 255
HOME_FILE_MAX_BYTES = 1024 * 1024


class SettingsError(ValueError):
    """A per-agent setting was refused; ``key`` is the dotted key it is about."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class SecretKind(str, enum.Enum):
    FILE = "file"
    CREDENTIAL = "credential"


@dataclass(frozen=True)
class SecretRef:
    """Where one secret value lives: a file path or a systemd credential name (never the value)."""

    kind: SecretKind
    target: str  # the absolute path, or the credential name

    @classmethod
    def parse(cls, text: Any, key: str) -> SecretRef:
        if not isinstance(text, str) or not text or "\0" in text:
            raise SettingsError(key, 'must be an absolute file path or "credential:NAME"')
        if text.startswith(CREDENTIAL_PREFIX):
            name = text[len(CREDENTIAL_PREFIX):]
            if not _CREDENTIAL_NAME.match(name) or name in (".", ".."):
                raise SettingsError(key, f"{text!r:.140} is not a systemd credential name (letters, digits, . _ -)")
            if name in RESERVED_CREDENTIALS:
                raise SettingsError(key, f"the credential {name!r} is the control server's own")
            return cls(SecretKind.CREDENTIAL, name)
        if not os.path.isabs(text):
            raise SettingsError(key, f"{text!r:.140} is not an absolute path (nor \"credential:NAME\")")
        return cls(SecretKind.FILE, os.path.normpath(text))

    def render(self) -> str:
        """The reference as written in the configuration."""
        return self.target if self.kind is SecretKind.FILE else CREDENTIAL_PREFIX + self.target


@dataclass(frozen=True)
class AgentSettings:
    """One agent's ``[agents.NAME]`` table."""

    name: str
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: Mapping[str, SecretRef] = field(default_factory=dict)
    # {path relative to the session's HOME: absolute host file} (``daemon.agents.home_files``)
    home_files: Mapping[str, str] = field(default_factory=dict)
    # this agent's memory bound in bytes (``daemon.agents.memory``); None: ``agents.max_memory``
    max_memory: int | None = None
    # its network (``daemon.agents.network``): a mode of its own (None: ``[network] mode``) and the
    # hosts it may reach besides its built-in ones and ``[network] allow_hosts``
    network: str | None = None
    allow_hosts: tuple[str, ...] = ()

    def secret_refs(self) -> dict[str, str]:
        """``{VAR: reference}``: what crosses to the control server (no value)."""
        return {var: ref.render() for var, ref in sorted(self.secret_env.items())}


def _check_var(name: Any, key: str) -> str:
    if not isinstance(name, str) or not _VAR.match(name):
        raise SettingsError(key, f"{name!r:.80} is not an environment variable name (letters, digits, _)")
    if name in RESERVED_VARS or name.startswith(RESERVED_PREFIXES):
        raise SettingsError(key, f"{name} is set by kandev itself and cannot be configured")
    return name


def check_home_dest(dest: Any, key: str) -> str:
    """A ``home_files`` destination: a plain relative path below the HOME (normalised)."""
    if not isinstance(dest, str) or not dest or "\0" in dest or len(dest) > MAX_HOME_PATH:
        raise SettingsError(key, f"must be a path relative to the session's HOME of at most {MAX_HOME_PATH} characters")
    parts = dest.split("/")
    if dest.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise SettingsError(key, f"{dest!r:.140} is not a plain relative path below the HOME (no leading /,"
                                 " no empty, . or .. component)")
    return dest


def _home_files(value: Any, base: str, suffix: str) -> dict[str, str]:
    key = f"{base}.home_files"
    if not isinstance(value, dict):
        raise SettingsError(key, f'must be a table of "path/in/home" = "/absolute/host/file"{suffix}')
    if len(value) > MAX_HOME_FILES:
        raise SettingsError(key, f"at most {MAX_HOME_FILES} files")
    out: dict[str, str] = {}
    for dest, source in value.items():
        check_home_dest(dest, f"{key}.{dest}")
        if not isinstance(source, str) or "\0" in source or not os.path.isabs(source):
            raise SettingsError(f"{key}.{dest}", f"{source!r:.140} is not an absolute path of a host file{suffix}")
        out[dest] = os.path.normpath(source)
    return out


def parse_agent_table(name: str, table: Any, where: str = "") -> AgentSettings:
    """``[agents.NAME]`` as read from the file; ``where`` (e.g. "in /etc/kandev/kandev.toml") goes
    into messages."""
    base = f"agents.{name}"
    suffix = f" {where}" if where else ""
    if name not in BUILTIN_AGENTS:
        known = ", ".join(sorted(BUILTIN_AGENTS))
        raise SettingsError(base, f"unknown agent {name!r}{suffix}; built-in agents: {known}")
    if not isinstance(table, dict):
        raise SettingsError(base, f"must be a table ([{base}]){suffix}")
    unknown = sorted(set(table) - {"env", "secret_env", "home_files", "max_memory", "network", "allow_hosts"})
    if unknown:
        raise SettingsError(f"{base}.{unknown[0]}",
                            f"unknown setting{suffix}; known: env, secret_env, home_files, max_memory, network,"
                            " allow_hosts")
    env: dict[str, str] = {}
    secrets: dict[str, SecretRef] = {}
    for part in ("env", "secret_env"):
        value = table.get(part, {})
        if not isinstance(value, dict):
            raise SettingsError(f"{base}.{part}", f'must be a table of VARIABLE = "..."{suffix}')
        if len(value) > MAX_VARS:
            raise SettingsError(f"{base}.{part}", f"at most {MAX_VARS} variables")
        for var, text in value.items():
            key = f"{base}.{part}.{var}"
            _check_var(var, key)
            if part == "env":
                if not isinstance(text, str) or "\0" in text or len(text) > MAX_VALUE:
                    raise SettingsError(key, f"must be a string of at most {MAX_VALUE} characters{suffix}")
                env[var] = text
            else:
                secrets[var] = SecretRef.parse(text, key)
    both = sorted(set(env) & set(secrets))
    if both:
        raise SettingsError(f"{base}.secret_env.{both[0]}", "is also in env; a variable is either plain or secret")
    mode, hosts = _network(table, base, suffix)
    return AgentSettings(name, env, secrets, _home_files(table.get("home_files", {}), base, suffix),
                         _max_memory(table.get("max_memory"), base, suffix), mode, hosts)


def _max_memory(value: Any, base: str, suffix: str) -> int | None:
    """``[agents.NAME] max_memory``: a size from 64 MiB to the host's RAM (``daemon.agents.memory``)."""
    if value is None:
        return None
    key = f"{base}.max_memory"
    try:
        bound = memory.parse_bytes(value)
    except ValueError as exc:
        raise SettingsError(key, f"{value!r:.80} {exc}{suffix}") from None
    if not memory.in_range(bound):
        raise SettingsError(key, f"{value!r:.80} is out of range{suffix}: accepted {memory.accepted()}")
    return bound


def _network(table: Mapping[str, Any], base: str, suffix: str) -> tuple[str | None, tuple[str, ...]]:
    """``network`` and ``allow_hosts`` of one ``[agents.NAME]`` table, checked (``daemon.agents.network``)."""
    mode = table.get("network")
    if mode is not None:
        try:
            check_mode(mode)
        except RuleError as exc:
            raise SettingsError(f"{base}.network", f"{exc}{suffix}") from None
    hosts = table.get("allow_hosts", [])
    if not isinstance(hosts, list):
        raise SettingsError(f"{base}.allow_hosts", f"{hosts!r:.80} is not a list of hosts{suffix}")
    try:
        parse_rules(hosts)
    except RuleError as exc:
        raise SettingsError(f"{base}.allow_hosts", f"has an entry refused: {exc}{suffix}") from None
    return mode, tuple(hosts)


def agent_env(name: str, configured: Mapping[str, AgentSettings]) -> dict[str, str]:
    """The plain environment of agent ``name``: its built-in defaults, then the configured ``env``."""
    agent = BUILTIN_AGENTS.get(name)
    env = dict(agent.default_env) if agent is not None else {}
    settings = configured.get(name)
    if settings is not None:
        env.update(settings.env)
    return env


# ---------------------------------------------------------------- the files themselves


def _service_ids() -> tuple[set[int], set[int]]:
    """Owners and groups a secret file may have: root and ourselves (the service user)."""
    uids, gids = {0, os.geteuid()}, {0, os.getegid()}
    try:
        import grp

        gids.add(grp.getgrnam(SERVICE_GROUP).gr_gid)
    except (KeyError, ImportError):
        pass
    return uids, gids


class KeyFileError(ValueError):
    """A secret (or ``home_files``) file kandev refuses: the message says what is wrong with it,
    ``fix`` what to do about it (a command where one does it)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.fix = fix


def check_secret_stat(st: os.stat_result, where: str) -> None:
    """Refuse a secret file that is not a regular file of root or ours with a safe mode
    (``KeyFileError``)."""
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{where} is not a regular file", "name a regular file (not a directory or a device)")
    uids, gids = _service_ids()
    if st.st_uid not in uids:
        raise KeyFileError(f"{where} is owned by uid {st.st_uid}; it must belong to root or the service user"
                           f" (uid {os.geteuid()})", f"chown {os.geteuid()} {where}")
    mode = stat.S_IMODE(st.st_mode)
    if mode not in ALLOWED_MODES:
        raise KeyFileError(f"{where} has mode {mode:04o}; it must be 0600 or 0640 (0400/0440 too): readable by"
                           " nobody but its owner and, at most, its group", f"chmod 600 {where}")
    if mode & stat.S_IRGRP and st.st_gid not in gids:
        raise KeyFileError(f"{where} is readable by group {st.st_gid}; a group-readable secret must belong to"
                           f" group root or {SERVICE_GROUP}", f"chgrp {SERVICE_GROUP} {where}, or chmod 600 {where}")


def secret_paths(configured: Mapping[str, AgentSettings]) -> list[str]:
    """Every secret file and ``home_files`` source of every agent: no agent's sandbox may show one
    (an agent sees its own files' copies in its HOME, never another agent's)."""
    return sorted({ref.target for s in configured.values() for ref in s.secret_env.values()
                   if ref.kind is SecretKind.FILE} | {src for s in configured.values() for src in s.home_files.values()})


def describe(configured: Mapping[str, AgentSettings], name: str) -> dict[str, Any]:
    """What ``kandev agents`` and ``kandev doctor`` show of an agent's settings: variable names
    (and where a secret comes from) and the files copied into its HOME (destination -> source),
    never a value nor a file's contents."""
    settings = configured.get(name)
    agent = BUILTIN_AGENTS.get(name)
    defaults = [var for var, _ in agent.default_env] if agent is not None else []
    return {
        "env": sorted(set(defaults) | set(settings.env if settings else {})),
        "secret_env": {var: ref.render() for var, ref in sorted((settings.secret_env if settings else {}).items())},
        "home_files": dict(sorted((settings.home_files if settings else {}).items())),
    }
