"""Operator settings: the TOML file, environment overrides, and their validation.

The file is ``--config FILE``, else ``$KANDEV_CONFIG``, else
``/etc/kandev/kandev.toml``; only that last, default file may be absent (then
every key has its default). Each key ``<section>.<key>`` is overridden by the
environment variable ``KANDEV_<SECTION>_<KEY>`` in upper case, e.g.
``KANDEV_AGENTCTL_RECOVERY_READ_RETRIES=3``. Every variable starting with
``KANDEV_FEATURES_``, ``KANDEV_AGENTCTL_``, ``KANDEV_DATABASE_``, ``KANDEV_STORE_``,
``KANDEV_CREDENTIALS_`` or ``KANDEV_AGENTS_`` is taken as a setting, so a misspelt one is refused like a misspelt file key.

Durations are written with a unit: ``ms``, ``s``, ``min``, ``h`` or ``d`` (``500ms``,
``30s``, ``10min``, ``1h``, ``90d``, decimals allowed); bare numbers are refused, except
``0`` for ``agentctl.idle_timeout`` (reaping disabled).

Every key is declared once, in ``SETTINGS``: its type, default, accepted range and the line the
README's configuration table shows (the table is generated from it, and a unit test checks it).

``load_config`` only parses: types, units, unknown keys. Ranges are checked by
the daemon that reads the key (README.md#configuration): ``validate_backend`` for the
recovery keys, ``validate_agentctl`` (run by the control server at its start,
on the values the backend hands it) for the retention limit and the unowned
period. Values are rejected, never clamped, except the unowned period, which
is adjusted and the adjustment recorded (AC-EXECUTORS-CONTROL-OWNERSHIP-003.4,
AC-EXECUTORS-CONTROL-OWNERSHIP-003.6, AC-EXECUTORS-CONTROL-OWNERSHIP-003.7). Every refusal is a ``ConfigError`` naming the key (and the
environment variable when the value came from there), the value as given and
what is accepted.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from difflib import get_close_matches
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from daemon.agents.settings import AgentSettings, SettingsError, parse_agent_table, validate_settings

DEFAULT_CONFIG_FILE = Path("/etc/kandev/kandev.toml")

MINUTE = 60.0
HOUR = 3600.0
DAY = 24 * HOUR
RETENTION_MIN = HOUR
RETENTION_MAX = 36500 * DAY
DEADLINE_MIN, DEADLINE_MAX = 1.0, 5 * MINUTE
READ_TIMEOUT_MIN = 0.1
READ_RETRIES_MAX = 10
READ_BUDGET_CAP = 6.0
EVENT_LIMIT_MIN, EVENT_LIMIT_MAX = 1, 10_000
UNOWNED_PERIOD_MAX = 24 * HOUR
UNOWNED_PERIOD_FLOOR = MINUTE
LEASE_TTL_MIN, LEASE_TTL_MAX = MINUTE, 24 * HOUR
DEFAULT_GITHUB_URL = "https://github.com"
DEFAULT_PUSH_REFS = ("refs/heads/*", "!@default")  # every branch except the repository's default branch
_EPSILON = 1e-9  # float slack for "<=" between sums of parsed durations

_DURATION = re.compile(r"^(-?)(\d+(?:\.\d+)?)(ms|s|min|h|d)$")
_FACTORS = {"d": DAY, "h": HOUR, "min": MINUTE, "s": 1.0}
_INTEGER = re.compile(r"^[+-]?\d+$")
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class ConfigError(ValueError):
    """A setting was refused. ``key`` is dotted; ``env_var`` is set when it came from there."""

    def __init__(self, message: str, *, key: str | None = None, env_var: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.env_var = env_var


# ---------------------------------------------------------------- the declaration of every key


class Kind(Enum):
    """How a value is written."""

    BOOL = "bool"  # true/false (and 1/0/yes/no from the environment)
    INT = "int"  # a whole number
    DURATION = "duration"  # a number with a unit: ms, s, min, h
    DURATION_OR_ZERO = "duration_or_zero"  # a duration, or a bare 0
    STR = "str"  # a non-empty string
    STR_LIST = "str_list"  # a list of non-empty strings (from the environment: comma-separated)
    CHOICE = "choice"  # one of ``Setting.choices``


@dataclass(frozen=True)
class Setting:
    """One operator setting, declared once: its type, default, accepted range and documentation.

    ``low``/``high`` are inclusive bounds (seconds for durations) checked by the daemon that reads
    the key, at its start; ``accepted`` is what a refusal quotes (derived from the kind and the
    bounds when left empty; ``note`` is added inside its parentheses); ``doc`` is the README's
    "accepted" column (``accepted`` when left empty). ``secret``: the value as given is never
    repeated (it may hold a password).

    Adding a key: one ``Setting`` in ``SETTINGS``, a field of the same name in its section's
    dataclass (default ``_default(key)``), the range check in the ``validate_*`` function of the
    daemon that reads it, a commented line in packaging/etc/kandev.toml; then regenerate the
    README's table (``markdown_table``). A new section also needs its dataclass in
    ``SECTION_TYPES`` and a field in ``Config``.
    """

    key: str  # "<section>.<name>"
    kind: Kind
    default: Any  # None: unset
    doc: str
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    accepted: str = ""
    note: str = ""
    secret: bool = False

    @property
    def section(self) -> str:
        return self.key.split(".")[0]

    @property
    def name(self) -> str:
        return self.key.split(".")[1]

    @property
    def env_var(self) -> str:
        return f"KANDEV_{self.key.replace('.', '_').upper()}"

    def accepts(self) -> str:
        """What the key accepts, as quoted in every refusal."""
        if self.accepted:
            return self.accepted
        fmt = _render_bound_int if self.kind is Kind.INT else _render_bound_duration
        note = f"; {self.note}" if self.note else ""
        if self.low is not None and self.high is not None:
            whole = "whole number, " if self.kind is Kind.INT else ""
            return f"{fmt(self.low)}..{fmt(self.high)} ({whole}inclusive{note})"
        if self.low is not None:
            return f">= {fmt(self.low)}" + (f" ({self.note})" if self.note else "")
        raise ValueError(f"{self.key}: declare accepted= or bounds")

    def in_range(self, value: float) -> bool:
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        return low - _EPSILON <= value <= high + _EPSILON

    def default_text(self) -> str:
        """The default as the README's table shows it."""
        if self.default is None:
            return "unset"
        if self.kind in (Kind.DURATION, Kind.DURATION_OR_ZERO):
            return f"`{format_duration(self.default)}`"
        return f"`{_render(self.default)}`"


def _render_bound_int(value: float) -> str:
    return str(int(value))


def _render_bound_duration(value: float) -> str:
    return format_duration(value)


@dataclass(frozen=True)
class Rule:
    """A rule between keys, shown in the README's table after the key ``after``."""

    label: str
    after: str
    doc: str


SANDBOX_POLICIES = ("required", "off")

SETTINGS: tuple[Setting, ...] = (
    Setting("features.agent_survival", Kind.BOOL, False,
            "`true`/`false`; takes effect at the next backend start", accepted="true or false"),
    Setting("features.auto_resume", Kind.BOOL, False,
            "`true`/`false`; at start, after recovery, resume the sessions the restart interrupted",
            accepted="true or false"),
    Setting("agentctl.detached_event_limit", Kind.INT, 100, "",
            low=EVENT_LIMIT_MIN, high=EVENT_LIMIT_MAX),
    Setting("agentctl.recovery_deadline", Kind.DURATION, 30.0, "",
            low=DEADLINE_MIN, high=DEADLINE_MAX),
    Setting("agentctl.recovery_read_timeout", Kind.DURATION, 2.0, "", low=READ_TIMEOUT_MIN),
    Setting("agentctl.recovery_read_retries", Kind.INT, 2, "", low=0, high=READ_RETRIES_MAX),
    Setting("agentctl.unowned_period", Kind.DURATION, 10 * MINUTE,
            "up to 24 h (above: rejected); below 1 min raised to 1 min; halved below `idle_timeout` when idle"
            " reaping is on (adjusted and logged)",
            low=0.0, high=UNOWNED_PERIOD_MAX, note="below 1min it is raised to 1min"),
    Setting("agentctl.idle_timeout", Kind.DURATION_OR_ZERO, HOUR, "a duration; `<= 0` disables idle reaping",
            accepted="a duration; 0 (or any duration <= 0) disables idle reaping"),
    Setting("database.url", Kind.STR, None,
            "a SQLAlchemy URL, e.g. `postgresql+psycopg://kandev@/kandev?host=/run/postgresql` (peer"
            " authentication over the Unix socket, no password in the file); unset means SQLite WAL at"
            " `<home>/kandev.db`. One backend per store: a second one is refused at start (a `<file>.lock`"
            " beside an SQLite file outside the home; a session advisory lock on PostgreSQL)",
            accepted="a non-empty SQLAlchemy URL; leave it unset for SQLite at <home>/kandev.db", secret=True),
    Setting("store.transcript_retention", Kind.DURATION, None,
            "e.g. `90d`: transcript entries older than this are removed (hourly, and at start); unset keeps"
            " every transcript. `kandev store vacuum` gives the space back to the filesystem",
            low=RETENTION_MIN, high=RETENTION_MAX),
    Setting("credentials.github_token_file", Kind.STR, None,
            "path of a 0600 file holding the upstream GitHub token; unset means no git credential leases",
            accepted="an absolute path to a 0600 file holding the upstream GitHub token (never the token"
            " itself); unset: no git credential leases"),
    Setting("credentials.lease_ttl", Kind.DURATION, HOUR, "", low=LEASE_TTL_MIN, high=LEASE_TTL_MAX),
    Setting("credentials.github_url", Kind.STR, DEFAULT_GITHUB_URL,
            "where the git host is: `https://github.com`, or a GitHub Enterprise Server's `https://HOST`;"
            " agents' git reaches it only through kandev's per-session git endpoint",
            accepted="an http(s) URL without user, query or fragment, e.g. https://github.com or"
            " https://ghe.example.com"),
    Setting("credentials.push_refs", Kind.STR_LIST, DEFAULT_PUSH_REFS,
            "ref globs an agent's push may update (`*` also matches `/`); the last matching one decides,"
            " `!` refuses, `@default` is the repository's default branch",
            accepted='a list of ref globs, each "refs/..." or "!refs/..." or "@default" / "!@default",'
            ' e.g. ["refs/heads/*", "!@default"]'),
    Setting("agents.sandbox", Kind.CHOICE, "required",
            '`"required"`: every agent in its bubblewrap sandbox; where none can be made, starting an agent'
            " fails with `sandbox_unavailable` (the reason and this key in the message). `\"off\"`: agents"
            " run unsandboxed, with a warning in the journal at every agent start",
            choices=SANDBOX_POLICIES,
            accepted='"required" (every agent in its bubblewrap sandbox) or "off" (agents unsandboxed)'),
    Setting("agents.max_processes", Kind.INT, 4096,
            "processes (and threads) one sandboxed agent may have at once: its `RLIMIT_NPROC`, which the"
            " kernel counts in that agent's own user namespace, so a fork bomb fails inside that agent only"
            " (docs/architecture.md); not enforced for agents run with `agents.sandbox = \"off\"`",
            low=64, high=65536),
)
RULES: tuple[Rule, ...] = (
    Rule("(read budget)", "agentctl.recovery_read_retries",
         "`recovery_read_timeout x (recovery_read_retries + 1) <= min(6 s, recovery_deadline / 5)`"),
)
SETTING: dict[str, Setting] = {s.key: s for s in SETTINGS}
# section -> its keys, in declaration order
SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(s.name for s in SETTINGS if s.section == section)
    for section in dict.fromkeys(s.section for s in SETTINGS)
}


def _default(key: str) -> Any:
    return SETTING[key].default


@dataclass(frozen=True)
class TableSetting:
    """A key of a per-name table (``[agents.NAME]``): not a scalar setting, but declared here too so
    the README's table is generated from one place (validated by ``daemon.agents.settings``)."""

    key: str
    default: str
    doc: str


TABLE_SETTINGS: tuple[TableSetting, ...] = (
    TableSetting("agents.NAME.env", "`{}`", 'that agent\'s plain settings (NAME: claude-code, codex, gemini, opencode, mock), e.g. `{ ANTHROPIC_BASE_URL = "...", ANTHROPIC_MODEL = "..." }`; at most 64 variables; not `HOME`, `PATH`, `USER`, `LOGNAME`, `PWD`, `SHELL`, `KANDEV_*`, `GIT_*`'),
    TableSetting("agents.NAME.secret_env", "`{}`", 'that agent\'s keys: `VARIABLE = "/absolute/path"` (a regular file, no symlink, mode 0600/0640/0400/0440, owner root or the service user, group root or the service group) or `VARIABLE = "credential:NAME"` (a systemd credential of `kandev-agentctl.service`: `LoadCredential=NAME:/path` in a drop-in)'),
    TableSetting("agents.NAME.home_files", "`{}`", 'files copied into each session\'s HOME before every launch of that agent (start, resume, restart): `"path/relative/to/HOME" = "/absolute/host/file"` (at most 32; the host file checked like a `secret_env` file; the copy mode 0600, never through a symlink in the HOME), e.g. `{ ".config/opencode/opencode.json" = "/etc/kandev/agents/opencode.json" }`'),
)


def markdown_table() -> str:
    """The README's configuration table, generated from ``SETTINGS`` and ``RULES`` (a unit test
    checks README.md holds exactly this; print it with
    ``python -c 'from daemon.config import markdown_table; print(markdown_table(), end="")'``)."""
    lines = ["| key | default | accepted |", "|---|---|---|"]
    for s in SETTINGS:
        lines.append(f"| `{s.key}` | {s.default_text()} | {s.doc or s.accepts()} |")
        lines.extend(f"| {r.label} | | {r.doc} |" for r in RULES if r.after == s.key)
    lines.extend(f"| `{t.key}` | {t.default} | {t.doc} |" for t in TABLE_SETTINGS)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the parsed configuration


@dataclass(frozen=True)
class FeaturesConfig:
    agent_survival: bool = _default("features.agent_survival")
    # Resume (ACP session/load) the sessions a restart interrupted, once startup recovery is done.
    auto_resume: bool = _default("features.auto_resume")


@dataclass(frozen=True)
class AgentctlConfig:
    """Durations are float seconds; ``unowned_period`` is the configured, unresolved value."""

    detached_event_limit: int = _default("agentctl.detached_event_limit")
    recovery_deadline: float = _default("agentctl.recovery_deadline")
    recovery_read_timeout: float = _default("agentctl.recovery_read_timeout")
    recovery_read_retries: int = _default("agentctl.recovery_read_retries")
    unowned_period: float = _default("agentctl.unowned_period")
    idle_timeout: float = _default("agentctl.idle_timeout")


@dataclass(frozen=True)
class DatabaseConfig:
    url: str | None = _default("database.url")  # None: SQLite at <home>/kandev.db


@dataclass(frozen=True)
class StoreConfig:
    """The store's upkeep: ``transcript_retention`` in float seconds, None keeps everything."""

    transcript_retention: float | None = _default("store.transcript_retention")


@dataclass(frozen=True)
class CredentialsConfig:
    """The git credential broker (daemon/credentials). ``github_token_file`` is the path of a 0600
    file holding the upstream GitHub token (the token itself is never a setting); ``lease_ttl``
    is in float seconds."""

    github_token_file: str | None = _default("credentials.github_token_file")
    lease_ttl: float = _default("credentials.lease_ttl")
    github_url: str = _default("credentials.github_url")
    push_refs: tuple[str, ...] = _default("credentials.push_refs")


@dataclass(frozen=True)
class AgentsConfig:
    """How agents run. ``sandbox``: ``required`` (every agent in its bubblewrap sandbox; a launch
    where none can be made fails with ``sandbox_unavailable``) or ``off`` (unsandboxed, warned)."""

    sandbox: str = _default("agents.sandbox")
    max_processes: int = _default("agents.max_processes")
    # ``[agents.NAME]`` tables: each agent's env and secret_env (daemon/agents/settings.py); a table
    # per agent rather than a declared key (see TABLE_FIELDS)
    settings: Mapping[str, AgentSettings] = field(default_factory=dict)


# section -> the dataclass holding its keys (a field per declared key; a unit test checks both agree)
SECTION_TYPES: dict[str, type] = {
    "features": FeaturesConfig,
    "agentctl": AgentctlConfig,
    "database": DatabaseConfig,
    "store": StoreConfig,
    "credentials": CredentialsConfig,
    "agents": AgentsConfig,
}
# section -> its fields that hold sub-tables ([agents.NAME]) instead of declared keys
TABLE_FIELDS: dict[str, tuple[str, ...]] = {"agents": ("settings",)}


@dataclass(frozen=True)
class Config:
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    agentctl: AgentctlConfig = field(default_factory=AgentctlConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    credentials: CredentialsConfig = field(default_factory=CredentialsConfig)
    agents: AgentsConfig = field(default_factory=AgentsConfig)
    source: str | None = None  # the file read, None if none was
    # dotted key -> where a non-default value came from: the file path or "env NAME".
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    # dotted key -> the value as the operator wrote it (TOML/quoted rendering).
    given: Mapping[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ResolvedAgentctl:
    """The control server's settings after validation; ``notes`` are adjustments to log."""

    detached_event_limit: int
    unowned_period: float
    idle_timeout: float
    notes: list[str]


# ---------------------------------------------------------------- durations


def parse_duration(text: str, *, allow_bare_zero: bool = False) -> float:
    """``"500ms"`` -> 0.5. Raises ``ValueError`` for a bare number or unknown unit."""
    s = text.strip()
    if allow_bare_zero and s in ("0", "-0", "+0"):
        return 0.0
    m = _DURATION.match(s)
    if not m:
        raise ValueError("is not a duration (write a number with a unit: ms, s, min, h or d)")
    sign, number, unit = m.groups()
    value = float(number) / 1000.0 if unit == "ms" else float(number) * _FACTORS[unit]
    return -value if sign else value


def format_duration(seconds: float) -> str:
    """The shortest exact spelling ``parse_duration`` reads back to the same value."""
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {seconds!r}")
    if seconds == 0:
        return "0s"
    sign, a = ("-" if seconds < 0 else ""), abs(seconds)
    for unit, factor in (("h", HOUR), ("min", MINUTE), ("s", 1.0), ("ms", 0.001)):
        n = round(a / factor)
        if n >= 1:
            text = f"{sign}{n}{unit}"
            if parse_duration(text) == seconds:
                return text
    text = repr(a)
    return f"{sign}{text if 'e' not in text else format(Decimal(a), 'f')}s"


# ---------------------------------------------------------------- loading


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return str(value)


class _Where:
    """Where one value came from, for messages."""

    def __init__(self, key: str, origin: str | None) -> None:
        self.key = key
        self.env_var = origin[4:] if origin and origin.startswith("env ") else None
        self.origin = origin

    def label(self) -> str:
        if self.env_var:
            return f"{self.key} (environment variable {self.env_var})"
        if self.origin and self.origin != "default":
            return f"{self.key} (in {self.origin})"
        return self.key

    def error(self, given: str, problem: str, accepted: str | None = None) -> ConfigError:
        accepted = accepted or SETTING[self.key].accepts()
        return ConfigError(
            f"{self.label()} = {given} {problem}: accepted {accepted}", key=self.key, env_var=self.env_var
        )


def _convert(kind: Kind, value: Any, where: _Where, *, text: bool) -> Any:
    """Type-check one value. ``text``: it came as a string (environment, argument), so "3" is 3."""
    given = _render(value)
    if kind is Kind.BOOL:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise where.error(given, "is not a boolean", "true/false/1/0/yes/no" if text else None)
    if kind is Kind.INT:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and isinstance(value, str) and _INTEGER.match(value.strip()):
            return int(value.strip())
        raise where.error(given, "is not a whole number")
    if kind in (Kind.DURATION, Kind.DURATION_OR_ZERO):
        zero_ok = kind is Kind.DURATION_OR_ZERO
        if zero_ok and isinstance(value, int) and not isinstance(value, bool) and value == 0:
            return 0.0
        if isinstance(value, str):
            try:
                return parse_duration(value, allow_bare_zero=zero_ok)
            except ValueError as e:
                raise where.error(given, str(e)) from None
        raise where.error(given, 'is not a duration (write a string with a unit: ms, s, min or h, "30s")')
    if kind is Kind.CHOICE:
        if isinstance(value, str) and value.strip() in SETTING[where.key].choices:
            return value.strip()
        raise where.error(given, "is not one of the choices")
    if kind is Kind.STR_LIST:
        items = value.split(",") if text and isinstance(value, str) else value
        if isinstance(items, list | tuple) and items and all(isinstance(v, str) and v.strip() for v in items):
            return tuple(v.strip() for v in items)
        raise where.error(given, "is not a non-empty list of non-empty strings")
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise where.error(given, "is not a non-empty string")


def _unknown(name: str, known: list[str], where: str) -> ConfigError:
    close = get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"unknown setting {name} {where}{hint}; known: {', '.join(sorted(known))}", key=name)


def _read_file(config_file: str | None, env: Mapping[str, str]) -> tuple[dict[str, Any], str | None]:
    explicit = config_file or env.get("KANDEV_CONFIG")
    path = Path(explicit) if explicit else DEFAULT_CONFIG_FILE
    try:
        with open(path, "rb") as f:
            return tomllib.load(f), str(path)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {path} does not exist") from None
        return {}, None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None


def _agent_tables(doc: dict[str, Any], source: str | None) -> dict[str, AgentSettings]:
    """``[agents.NAME]`` tables (only from the file: they have no environment variables)."""
    out: dict[str, AgentSettings] = {}
    agents = doc.get("agents")
    if not isinstance(agents, dict):
        return out
    for name, table in agents.items():
        if isinstance(table, dict):
            try:
                out[name] = parse_agent_table(name, table, f"in {source}")
            except SettingsError as exc:
                raise ConfigError(str(exc), key=exc.key) from None
    return out


def _collect(doc: dict[str, Any], source: str | None, env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Every value given, by dotted key, with where it came from; unknown keys are refused."""
    known = list(SETTING)
    raw: dict[str, tuple[Any, str]] = {}
    for section, table in doc.items():
        if section not in SECTIONS:
            raise _unknown(section, list(SECTIONS), f"in {source} (a section)")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {source} must be a table ([{section}])", key=section)
        for key, value in table.items():
            dotted = f"{section}.{key}"
            if section == "agents" and isinstance(value, dict):
                continue  # an [agents.NAME] table: _agent_tables
            if dotted not in SETTING:
                raise _unknown(dotted, known, f"in {source}")
            raw[dotted] = (value, str(source))
    for name, value in env.items():
        for section in SECTIONS:
            prefix = f"KANDEV_{section.upper()}_"
            if name.startswith(prefix):
                key = name[len(prefix):].lower()
                if key not in SECTIONS[section]:
                    raise _unknown(name, [s.env_var for s in SETTINGS], "in the environment")
                raw[f"{section}.{key}"] = (value, f"env {name}")
    return raw


def load_config(config_file: str | None, env: Mapping[str, str] | None = None) -> Config:
    """Parse the file and the environment into a ``Config``; ranges are not checked here."""
    environ = os.environ if env is None else env
    doc, source = _read_file(config_file, environ)
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    origins: dict[str, str] = {}
    given: dict[str, str] = {}
    for dotted, (value, origin) in _collect(doc, source, environ).items():
        setting = SETTING[dotted]
        where = _Where(dotted, origin)
        values[setting.section][setting.name] = _convert(setting.kind, value, where, text=where.env_var is not None)
        origins[dotted] = origin
        given[dotted] = '"<hidden>"' if setting.secret else _render(value)
    return Config(
        **{section: SECTION_TYPES[section](**values[section]) for section in SECTIONS if section != "agents"},
        agents=AgentsConfig(**values["agents"], settings=_agent_tables(doc, source)),
        source=source,
        origins=origins,
        given=given,
    )


# ---------------------------------------------------------------- validation


def _given(config: Config, key: str, value: float, duration: bool = True) -> str:
    if key in config.given:
        return config.given[key]
    return json.dumps(format_duration(value)) if duration else str(value)


def _check_range(key: str, value: float, given: str, origin: str | None) -> None:
    """Refuse ``value`` outside the declared bounds of ``key``, naming key, value and range."""
    if not SETTING[key].in_range(value):
        raise _Where(key, origin).error(given, "is out of range")


def _check_config_range(config: Config, key: str, value: float) -> None:
    duration = SETTING[key].kind is not Kind.INT
    _check_range(key, value, _given(config, key, value, duration), config.origins.get(key))


def validate_credentials(config: Config) -> None:
    """Check the credential broker's keys (read by the backend; called by ``validate_backend``)."""
    c = config.credentials
    _check_config_range(config, "credentials.lease_ttl", c.lease_ttl)
    if c.github_token_file is not None and not os.path.isabs(c.github_token_file):
        raise _Where("credentials.github_token_file", config.origins.get("credentials.github_token_file")).error(
            config.given.get("credentials.github_token_file", json.dumps(c.github_token_file)),
            "is not an absolute path",
        )
    url = urlsplit(c.github_url)
    try:
        url.port  # noqa: B018  (raises on a bad port)
        bad_port = False
    except ValueError:
        bad_port = True
    if (url.scheme not in ("http", "https") or not url.hostname or bad_port or url.username or url.password
            or url.query or url.fragment):
        raise _Where("credentials.github_url", config.origins.get("credentials.github_url")).error(
            config.given.get("credentials.github_url", json.dumps(c.github_url)), "is not a usable git host URL")
    for pattern in c.push_refs:
        glob = pattern[1:] if pattern.startswith("!") else pattern
        if glob != "@default" and (not glob.startswith("refs/") or any(ch.isspace() for ch in glob)):
            raise _Where("credentials.push_refs", config.origins.get("credentials.push_refs")).error(
                config.given.get("credentials.push_refs", json.dumps(list(c.push_refs))),
                f"has an entry that is not a ref glob: {json.dumps(pattern)}")


def validate_agents(config: Config) -> None:
    """Check each ``[agents.NAME] secret_env`` file and ``home_files`` source (present, a regular file
    of root or the service user, mode 0600/0640), without reading it; ``credential:`` ones are the
    control server's to check."""
    try:
        validate_settings(config.agents.settings)
    except SettingsError as exc:
        where = f" (in {config.source})" if config.source else ""
        raise ConfigError(f"{exc.key}{where}: {str(exc)[len(exc.key) + 2:]}", key=exc.key) from None
    _check_config_range(config, "agents.max_processes", config.agents.max_processes)


def validate_backend(config: Config) -> None:
    """Check the keys the backend reads (AC-EXECUTORS-SURVIVAL-002.13, AC-EXECUTORS-SURVIVAL-003.7; credentials; agents)."""
    validate_credentials(config)
    validate_agents(config)
    if config.store.transcript_retention is not None:
        _check_config_range(config, "store.transcript_retention", config.store.transcript_retention)
    a = config.agentctl

    def where(key: str) -> _Where:
        return _Where(f"agentctl.{key}", config.origins.get(f"agentctl.{key}"))

    d, t, r = a.recovery_deadline, a.recovery_read_timeout, a.recovery_read_retries
    _check_config_range(config, "agentctl.recovery_deadline", d)
    _check_config_range(config, "agentctl.recovery_read_timeout", t)
    _check_config_range(config, "agentctl.recovery_read_retries", r)
    budget, ceiling = t * (r + 1), min(READ_BUDGET_CAP, d / 5)
    if budget > ceiling + _EPSILON:
        parts = ", ".join(
            f"{where(k).label()} = {_given(config, f'agentctl.{k}', v, dur)}"
            for k, v, dur in (("recovery_read_timeout", t, True), ("recovery_read_retries", r, False),
                              ("recovery_deadline", d, True))
        )
        raise ConfigError(
            f"the recovery read budget is too large: recovery_read_timeout x (recovery_read_retries + 1)"
            f" = {format_duration(t)} x {r + 1} = {format_duration(budget)} must be <= min(6s,"
            f" recovery_deadline / 5) = min(6s, {format_duration(d)} / 5) = {format_duration(ceiling)}"
            f" ({parts}). With the default read timeout (2s) and retries (2) the budget is 6s, so any"
            " recovery_deadline below 30s is rejected; lower agentctl.recovery_read_timeout or"
            " agentctl.recovery_read_retries, or raise agentctl.recovery_deadline"
            " (AC-EXECUTORS-SURVIVAL-002.13).",
            key="agentctl.recovery_read_timeout",
            env_var=where("recovery_read_timeout").env_var,
        )


def config_file(config_file: str | None, env: Mapping[str, str] | None = None) -> str:
    """The file a daemon given ``config_file`` reads: that one, else ``$KANDEV_CONFIG``, else the default."""
    environ = os.environ if env is None else env
    return str(config_file or environ.get("KANDEV_CONFIG") or DEFAULT_CONFIG_FILE)


def check_config(config_file: str | None, env: Mapping[str, str] | None = None) -> Config:
    """What the backend checks at start (``kandev up`` and ``kandev doctor`` check the same, before
    starting anything): the file and the environment, the backend's keys, the control server's."""
    config = load_config(config_file, env)
    validate_backend(config)
    a = config.agentctl
    validate_agentctl(a.detached_event_limit, a.unowned_period, a.idle_timeout, origins=config.origins)
    return config


def resolve_unowned_period(period: float, idle_timeout: float) -> tuple[float, list[str]]:
    """Apply the idle-timeout ordering and the 1 min floor; return the period and what changed.

    AC-EXECUTORS-CONTROL-OWNERSHIP-003.4: with reaping on (idle > 0) the period
    must be shorter than the idle timeout, else it becomes idle/2. AC-EXECUTORS-CONTROL-OWNERSHIP-003.6: with
    reaping off (idle <= 0) the period is used unchanged. AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: then at least
    1 min, even if that breaks the ordering (recorded, and the server starts).
    """
    notes: list[str] = []
    effective = period
    if idle_timeout > 0 and effective >= idle_timeout:
        effective = idle_timeout / 2
        notes.append(
            f"agentctl.unowned_period {format_duration(period)} is not shorter than agentctl.idle_timeout"
            f" {format_duration(idle_timeout)}: using half the idle timeout, {format_duration(effective)}"
            " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.4)"
        )
    if effective < UNOWNED_PERIOD_FLOOR:
        notes.append(
            f"agentctl.unowned_period {format_duration(effective)} is below the 1min floor: using 1min"
            " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.7)"
        )
        effective = UNOWNED_PERIOD_FLOOR
        if idle_timeout > 0 and effective >= idle_timeout:
            notes.append(
                f"the ordering unowned_period < idle_timeout ({format_duration(idle_timeout)}) cannot be met"
                " together with the 1min floor: using 1min anyway; the idle reaper may stop instances first"
                " (AC-EXECUTORS-CONTROL-OWNERSHIP-003.7)"
            )
    return effective, notes


def _agentctl_value(kind: Kind, key: str, value: Any, origin: str | None) -> tuple[Any, str]:
    """A control-server value (number, or text as handed over) and its rendering for messages."""
    where = _Where(f"agentctl.{key}", origin)
    if kind is not Kind.INT and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise where.error(_render(value), "is not a duration")
        return float(value), json.dumps(format_duration(float(value)))
    return _convert(kind, value, where, text=True), _render(value)


def validate_agentctl(
    detached_event_limit: int | float | str,
    unowned_period: float | str,
    idle_timeout: float | str,
    *,
    origins: Mapping[str, str] | None = None,
) -> ResolvedAgentctl:
    """Check and resolve the control server's keys at its start.

    Values may be numbers (seconds) or the strings the backend hands over
    (``format_duration`` spellings). ``origins`` maps a dotted key to ``env
    NAME`` or a file, for messages. AC-EXECUTORS-SURVIVAL-001.8: the limit is a
    whole number in 1..10000, else refused (never clamped).
    """
    o = origins or {}
    limit, limit_given = _agentctl_value(Kind.INT, "detached_event_limit", detached_event_limit,
                                         o.get("agentctl.detached_event_limit"))
    _check_range("agentctl.detached_event_limit", limit, limit_given, o.get("agentctl.detached_event_limit"))
    idle, _ = _agentctl_value(Kind.DURATION_OR_ZERO, "idle_timeout", idle_timeout,
                              o.get("agentctl.idle_timeout"))
    period, period_given = _agentctl_value(Kind.DURATION, "unowned_period", unowned_period,
                                           o.get("agentctl.unowned_period"))
    _check_range("agentctl.unowned_period", period, period_given, o.get("agentctl.unowned_period"))
    resolved, notes = resolve_unowned_period(period, idle)
    return ResolvedAgentctl(limit, resolved, idle, notes)


def agentctl_settings(config: Config) -> dict[str, str]:
    """The control server's keys as strings to hand to it (arguments or ``Environment=``)."""
    a = config.agentctl
    return {
        "detached_event_limit": str(a.detached_event_limit),
        "unowned_period": format_duration(a.unowned_period),
        "idle_timeout": format_duration(a.idle_timeout),
    }
