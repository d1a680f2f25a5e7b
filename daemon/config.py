"""Operator settings: the TOML file, environment overrides, and their validation.

The file is ``--config FILE``, else ``$KANDEV_CONFIG``, else
``/etc/kandev/kandev.toml``; only that last, default file may be absent (then
every key has its default). Each key ``<section>.<key>`` is overridden by the
environment variable ``KANDEV_<SECTION>_<KEY>`` in upper case, e.g.
``KANDEV_AGENTCTL_RECOVERY_READ_RETRIES=3``. Every variable starting with
``KANDEV_FEATURES_``, ``KANDEV_AGENTCTL_``, ``KANDEV_DATABASE_``, ``KANDEV_CREDENTIALS_`` or
``KANDEV_AGENTS_`` is taken as a setting, so a misspelt one is refused like a misspelt file key.

Durations are written with a unit: ``ms``, ``s``, ``min`` or ``h`` (``500ms``,
``30s``, ``10min``, ``1h``, decimals allowed); bare numbers are refused, except
``0`` for ``agentctl.idle_timeout`` (reaping disabled).

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
from pathlib import Path
from typing import Any

from daemon.agents.settings import AgentSettings, SettingsError, parse_agent_table, validate_settings

DEFAULT_CONFIG_FILE = Path("/etc/kandev/kandev.toml")

MINUTE = 60.0
HOUR = 3600.0
DEADLINE_MIN, DEADLINE_MAX = 1.0, 5 * MINUTE
READ_TIMEOUT_MIN = 0.1
READ_RETRIES_MAX = 10
READ_BUDGET_CAP = 6.0
EVENT_LIMIT_MIN, EVENT_LIMIT_MAX = 1, 10_000
UNOWNED_PERIOD_MAX = 24 * HOUR
UNOWNED_PERIOD_FLOOR = MINUTE
LEASE_TTL_MIN, LEASE_TTL_MAX = MINUTE, 24 * HOUR
_EPSILON = 1e-9  # float slack for "<=" between sums of parsed durations

_DURATION = re.compile(r"^(-?)(\d+(?:\.\d+)?)(ms|s|min|h)$")
_FACTORS = {"h": HOUR, "min": MINUTE, "s": 1.0}
_INTEGER = re.compile(r"^[+-]?\d+$")
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class ConfigError(ValueError):
    """A setting was refused. ``key`` is dotted; ``env_var`` is set when it came from there."""

    def __init__(self, message: str, *, key: str | None = None, env_var: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.env_var = env_var


@dataclass(frozen=True)
class FeaturesConfig:
    agent_survival: bool = False
    # Resume (ACP session/load) the sessions a restart interrupted, once startup recovery is done.
    auto_resume: bool = False


@dataclass(frozen=True)
class AgentctlConfig:
    """Durations are float seconds; ``unowned_period`` is the configured, unresolved value."""

    detached_event_limit: int = 100
    recovery_deadline: float = 30.0
    recovery_read_timeout: float = 2.0
    recovery_read_retries: int = 2
    unowned_period: float = 10 * MINUTE
    idle_timeout: float = HOUR


@dataclass(frozen=True)
class DatabaseConfig:
    url: str | None = None  # None: SQLite at <home>/kandev.db


@dataclass(frozen=True)
class CredentialsConfig:
    """The git credential broker (daemon/credentials). ``github_token_file`` is the path of a 0600
    file holding the upstream GitHub token (the token itself is never a setting); ``lease_ttl``
    is in float seconds."""

    github_token_file: str | None = None
    lease_ttl: float = HOUR


SANDBOX_POLICIES = ("required", "off")


@dataclass(frozen=True)
class AgentsConfig:
    """How agents run. ``sandbox``: ``required`` (every agent in its bubblewrap sandbox; a launch
    where none can be made fails with ``sandbox_unavailable``) or ``off`` (unsandboxed, warned)."""

    sandbox: str = "required"
    # ``[agents.NAME]`` tables: each agent's env and secret_env (daemon/agents/settings.py).
    settings: Mapping[str, AgentSettings] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    agentctl: AgentctlConfig = field(default_factory=AgentctlConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
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


_KINDS: dict[str, dict[str, str]] = {
    "features": {"agent_survival": "bool", "auto_resume": "bool"},
    "agentctl": {
        "detached_event_limit": "int",
        "recovery_deadline": "duration",
        "recovery_read_timeout": "duration",
        "recovery_read_retries": "int",
        "unowned_period": "duration",
        "idle_timeout": "duration_or_zero",
    },
    "database": {"url": "str"},
    "credentials": {"github_token_file": "str", "lease_ttl": "duration"},
    "agents": {"sandbox": "sandbox_policy"},
}


# What each key accepts, quoted in every refusal.
_ACCEPTED = {
    "features.agent_survival": "true or false",
    "features.auto_resume": "true or false",
    "agentctl.detached_event_limit": "1..10000 (whole number, inclusive)",
    "agentctl.recovery_deadline": "1s..5min (inclusive)",
    "agentctl.recovery_read_timeout": ">= 100ms",
    "agentctl.recovery_read_retries": "0..10 (whole number, inclusive)",
    "agentctl.unowned_period": "0s..24h (inclusive; below 1min it is raised to 1min)",
    "agentctl.idle_timeout": "a duration; 0 (or any duration <= 0) disables idle reaping",
    "database.url": "a non-empty SQLAlchemy URL; leave it unset for SQLite at <home>/kandev.db",
    "credentials.github_token_file": "an absolute path to a 0600 file holding the upstream GitHub token"
    " (never the token itself); unset: no git credential leases",
    "credentials.lease_ttl": "1min..24h (inclusive)",
    "agents.sandbox": '"required" (every agent in its bubblewrap sandbox) or "off" (agents unsandboxed)',
}


# ---------------------------------------------------------------- durations


def parse_duration(text: str, *, allow_bare_zero: bool = False) -> float:
    """``"500ms"`` -> 0.5. Raises ``ValueError`` for a bare number or unknown unit."""
    s = text.strip()
    if allow_bare_zero and s in ("0", "-0", "+0"):
        return 0.0
    m = _DURATION.match(s)
    if not m:
        raise ValueError("is not a duration (write a number with a unit: ms, s, min or h)")
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
        accepted = accepted or _ACCEPTED[self.key]
        return ConfigError(
            f"{self.label()} = {given} {problem}: accepted {accepted}", key=self.key, env_var=self.env_var
        )


def _convert(kind: str, value: Any, where: _Where, *, text: bool) -> Any:
    """Type-check one value. ``text``: it came as a string (environment, argument), so "3" is 3."""
    given = _render(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise where.error(given, "is not a boolean", "true/false/1/0/yes/no" if text else None)
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and isinstance(value, str) and _INTEGER.match(value.strip()):
            return int(value.strip())
        raise where.error(given, "is not a whole number")
    if kind in ("duration", "duration_or_zero"):
        zero_ok = kind == "duration_or_zero"
        if zero_ok and isinstance(value, int) and not isinstance(value, bool) and value == 0:
            return 0.0
        if isinstance(value, str):
            try:
                return parse_duration(value, allow_bare_zero=zero_ok)
            except ValueError as e:
                raise where.error(given, str(e)) from None
        raise where.error(given, 'is not a duration (write a string with a unit: ms, s, min or h, "30s")')
    if kind == "sandbox_policy":
        if isinstance(value, str) and value.strip() in SANDBOX_POLICIES:
            return value.strip()
        raise where.error(given, "is not a sandbox policy")
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
    known = [f"{s}.{k}" for s, keys in _KINDS.items() for k in keys]
    raw: dict[str, tuple[Any, str]] = {}
    for section, table in doc.items():
        if section not in _KINDS:
            raise _unknown(section, list(_KINDS), f"in {source} (a section)")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} in {source} must be a table ([{section}])", key=section)
        for key, value in table.items():
            dotted = f"{section}.{key}"
            if section == "agents" and isinstance(value, dict):
                continue  # an [agents.NAME] table: _agent_tables
            if key not in _KINDS[section]:
                raise _unknown(dotted, known, f"in {source}")
            raw[dotted] = (value, str(source))
    for name, value in env.items():
        for section in _KINDS:
            prefix = f"KANDEV_{section.upper()}_"
            if name.startswith(prefix):
                key = name[len(prefix):].lower()
                if key not in _KINDS[section]:
                    env_names = [f"KANDEV_{k.replace('.', '_').upper()}" for k in known]
                    raise _unknown(name, env_names, "in the environment")
                raw[f"{section}.{key}"] = (value, f"env {name}")
    return raw


def load_config(config_file: str | None, env: Mapping[str, str] | None = None) -> Config:
    """Parse the file and the environment into a ``Config``; ranges are not checked here."""
    environ = os.environ if env is None else env
    doc, source = _read_file(config_file, environ)
    values: dict[str, dict[str, Any]] = {s: {} for s in _KINDS}
    origins: dict[str, str] = {}
    given: dict[str, str] = {}
    for dotted, (value, origin) in _collect(doc, source, environ).items():
        section, key = dotted.split(".")
        where = _Where(dotted, origin)
        values[section][key] = _convert(_KINDS[section][key], value, where, text=where.env_var is not None)
        origins[dotted] = origin
        given[dotted] = '"<hidden>"' if dotted == "database.url" else _render(value)  # may hold a password
    return Config(
        features=FeaturesConfig(**values["features"]),
        agentctl=AgentctlConfig(**values["agentctl"]),
        database=DatabaseConfig(**values["database"]),
        credentials=CredentialsConfig(**values["credentials"]),
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


def validate_credentials(config: Config) -> None:
    """Check the credential broker's keys (read by the backend; called by ``validate_backend``)."""
    c = config.credentials
    if not LEASE_TTL_MIN - _EPSILON <= c.lease_ttl <= LEASE_TTL_MAX + _EPSILON:
        raise _Where("credentials.lease_ttl", config.origins.get("credentials.lease_ttl")).error(
            _given(config, "credentials.lease_ttl", c.lease_ttl), "is out of range"
        )
    if c.github_token_file is not None and not os.path.isabs(c.github_token_file):
        raise _Where("credentials.github_token_file", config.origins.get("credentials.github_token_file")).error(
            config.given.get("credentials.github_token_file", json.dumps(c.github_token_file)),
            "is not an absolute path",
        )


def validate_agents(config: Config) -> None:
    """Check each ``[agents.NAME] secret_env`` file (present, a regular file of root or the service
    user, mode 0600/0640), without reading it; ``credential:`` ones are the control server's to check."""
    try:
        validate_settings(config.agents.settings)
    except SettingsError as exc:
        where = f" (in {config.source})" if config.source else ""
        raise ConfigError(f"{exc.key}{where}: {str(exc)[len(exc.key) + 2:]}", key=exc.key) from None


def validate_backend(config: Config) -> None:
    """Check the keys the backend reads (AC-EXECUTORS-SURVIVAL-002.13, AC-EXECUTORS-SURVIVAL-003.7; credentials; agents)."""
    validate_credentials(config)
    validate_agents(config)
    a = config.agentctl

    def where(key: str) -> _Where:
        return _Where(f"agentctl.{key}", config.origins.get(f"agentctl.{key}"))

    d, t, r = a.recovery_deadline, a.recovery_read_timeout, a.recovery_read_retries
    if not DEADLINE_MIN - _EPSILON <= d <= DEADLINE_MAX + _EPSILON:
        raise where("recovery_deadline").error(
            _given(config, "agentctl.recovery_deadline", d), "is out of range"
        )
    if t < READ_TIMEOUT_MIN - _EPSILON:
        raise where("recovery_read_timeout").error(
            _given(config, "agentctl.recovery_read_timeout", t), "is out of range"
        )
    if not 0 <= r <= READ_RETRIES_MAX:
        raise where("recovery_read_retries").error(
            _given(config, "agentctl.recovery_read_retries", r, duration=False),
            "is out of range",
        )
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


def _agentctl_value(kind: str, key: str, value: Any, origin: str | None) -> tuple[Any, str]:
    """A control-server value (number, or text as handed over) and its rendering for messages."""
    where = _Where(f"agentctl.{key}", origin)
    if kind != "int" and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise where.error(_render(value), "is not a duration")
        return float(value), json.dumps(format_duration(float(value)))
    return _convert(kind, value, where, text=True), _render(value)


def validate_agentctl(
    detached_event_limit: int | str,
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
    limit, limit_given = _agentctl_value("int", "detached_event_limit", detached_event_limit,
                                         o.get("agentctl.detached_event_limit"))
    if not EVENT_LIMIT_MIN <= limit <= EVENT_LIMIT_MAX:
        raise _Where("agentctl.detached_event_limit", o.get("agentctl.detached_event_limit")).error(
            limit_given, "is out of range"
        )
    idle, _ = _agentctl_value("duration_or_zero", "idle_timeout", idle_timeout,
                              o.get("agentctl.idle_timeout"))
    period, period_given = _agentctl_value("duration", "unowned_period", unowned_period,
                                           o.get("agentctl.unowned_period"))
    if not 0 <= period <= UNOWNED_PERIOD_MAX + _EPSILON:
        raise _Where("agentctl.unowned_period", o.get("agentctl.unowned_period")).error(
            period_given, "is out of range"
        )
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
