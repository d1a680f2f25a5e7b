"""Operator settings: the TOML file, environment overrides, and their validation.

The file is ``--config FILE``, else ``$KANDEV_CONFIG``, else
``/etc/kandev/kandev.toml``; only that last, default file may be absent (then
every key has its default). Each key ``<section>.<key>`` is overridden by the
environment variable ``KANDEV_<SECTION>_<KEY>`` in upper case, e.g.
``KANDEV_AGENTCTL_RECOVERY_READ_RETRIES=3``. Every variable starting with
``KANDEV_FEATURES_``, ``KANDEV_AGENTCTL_``, ``KANDEV_DATABASE_``, ``KANDEV_STORE_``,
``KANDEV_CREDENTIALS_``, ``KANDEV_AGENTS_``, ``KANDEV_CLUSTER_`` or ``KANDEV_NETWORK_`` is taken as a setting, so a misspelt one is refused like a misspelt file key.

Durations are written with a unit: ``ms``, ``s``, ``min``, ``h`` or ``d`` (``500ms``,
``30s``, ``10min``, ``1h``, ``90d``, decimals allowed); bare numbers are refused, except
``0`` for ``agentctl.idle_timeout`` (reaping disabled).

Every key is declared once, in ``daemon.config.keys.SETTINGS``: its type, default, accepted range
and the line the README's configuration table shows (the table is generated from it, and a unit
test checks it); that module also owns how one value is written (durations, conversion, refusals).
This module owns the parsed ``Config`` (a dataclass per section), reading the file and the
environment into it, and the backend's checks.

``load_config`` only parses: types, units, unknown keys. Ranges are checked by
the daemon that reads the key (README.md#configuration): ``validate_backend`` for the
recovery keys, ``daemon.config.agentctl.validate_agentctl`` (run by the control server at its start,
on the values the backend hands it) for the retention limit and the unowned
period. Values are rejected, never clamped, except the unowned period, which
is adjusted and the adjustment recorded (AC-EXECUTORS-CONTROL-OWNERSHIP-003.4,
AC-EXECUTORS-CONTROL-OWNERSHIP-003.6, AC-EXECUTORS-CONTROL-OWNERSHIP-003.7). Every refusal is a ``ConfigError`` naming the key (and the
environment variable when the value came from there), the value as given and
what is accepted.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from daemon.agents import memory
from daemon.agents.file_checks import check_secret_file, validate_settings
from daemon.agents.network import NetworkPolicy, RuleError, effective_policy, parse_host_port, parse_host_rule
from daemon.agents.registry import BUILTIN_AGENTS
from daemon.agents.settings import (
    AgentSettings,
    KeyFileError,
    SecretKind,
    SecretRef,
    SettingsError,
    parse_agent_table,
)
from daemon.config.agentctl import validate_agentctl
from daemon.config.keys import (
    EPSILON,
    HEARTBEATS_PER_TIMEOUT,
    HOST_NAME,
    READ_BUDGET_CAP,
    SECTIONS,
    SETTING,
    SETTINGS,
    ConfigError,
    Kind,
    Where,
    check_range,
    convert,
    format_duration,
    render_value,
)

DEFAULT_CONFIG_FILE = Path("/etc/kandev/kandev.toml")


def _default(key: str) -> Any:
    return SETTING[key].default


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
    # where the PostgreSQL password is: a file path or "credential:NAME" (daemon.store.password)
    password_file: str | None = _default("database.password_file")


@dataclass(frozen=True)
class ClusterConfig:
    """Several hosts on one PostgreSQL (docs/cluster.md): this host's name (None: a single host),
    seconds between its heartbeats, and seconds without one before a host is unreachable."""

    host: str | None = _default("cluster.host")
    heartbeat_s: int = _default("cluster.heartbeat_s")
    host_timeout_s: int = _default("cluster.host_timeout_s")


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
    # seconds of silence before a running turn is shown as waiting for its agent, and before it is
    # ended with reason timeout (0: never): daemon/backend/state/quiet_turns.py
    quiet_warning_s: int = _default("agents.quiet_warning_s")
    turn_timeout_s: int = _default("agents.turn_timeout_s")
    max_memory: int | None = _default("agents.max_memory")  # bytes; None: half the host's RAM
    # ``[agents.NAME]`` tables: each agent's env and secret_env (daemon/agents/settings.py); a table
    # per agent rather than a declared key (see TABLE_FIELDS)
    settings: Mapping[str, AgentSettings] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkConfig:
    """What agents may reach (``daemon.agents.network``): the mode, the hosts every agent may reach
    besides its own provider's, and the exact private destinations allowed (as written; checked by
    ``validate_network``)."""

    mode: str = _default("network.mode")
    allow_hosts: tuple[str, ...] = _default("network.allow_hosts")
    host_ports: tuple[str, ...] = _default("network.host_ports")


# section -> the dataclass holding its keys (a field per declared key; a unit test checks both agree)
SECTION_TYPES: dict[str, type] = {
    "features": FeaturesConfig,
    "agentctl": AgentctlConfig,
    "database": DatabaseConfig,
    "store": StoreConfig,
    "credentials": CredentialsConfig,
    "agents": AgentsConfig,
    "cluster": ClusterConfig,
    "network": NetworkConfig,
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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    source: str | None = None  # the file read, None if none was
    # dotted key -> where a non-default value came from: the file path or "env NAME".
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)
    # dotted key -> the value as the operator wrote it (TOML/quoted rendering).
    given: Mapping[str, str] = field(default_factory=dict, compare=False)


# ---------------------------------------------------------------- loading


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
        where = Where(dotted, origin)
        values[setting.section][setting.name] = convert(setting.kind, value, where, text=where.env_var is not None)
        origins[dotted] = origin
        given[dotted] = '"<hidden>"' if setting.secret else render_value(value)
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


def _check_config_range(config: Config, key: str, value: float) -> None:
    duration = SETTING[key].kind is not Kind.INT
    check_range(key, value, _given(config, key, value, duration), config.origins.get(key))


def validate_credentials(config: Config) -> None:
    """Check the credential broker's keys (read by the backend; called by ``validate_backend``)."""
    c = config.credentials
    _check_config_range(config, "credentials.lease_ttl", c.lease_ttl)
    if c.github_token_file is not None and not os.path.isabs(c.github_token_file):
        raise Where("credentials.github_token_file", config.origins.get("credentials.github_token_file")).error(
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
        raise Where("credentials.github_url", config.origins.get("credentials.github_url")).error(
            config.given.get("credentials.github_url", json.dumps(c.github_url)), "is not a usable git host URL")
    for pattern in c.push_refs:
        glob = pattern[1:] if pattern.startswith("!") else pattern
        if glob != "@default" and (not glob.startswith("refs/") or any(ch.isspace() for ch in glob)):
            raise Where("credentials.push_refs", config.origins.get("credentials.push_refs")).error(
                config.given.get("credentials.push_refs", json.dumps(list(c.push_refs))),
                f"has an entry that is not a ref glob: {json.dumps(pattern)}")


def validate_agents(config: Config, files: bool = True) -> None:
    """Check each ``[agents.NAME] secret_env`` file and ``home_files`` source (present, a regular file
    of root or the service user, mode 0600/0640, a key file not empty; ``daemon.agents.file_checks``),
    unless not ``files``; ``credential:`` ones are the control server's to check."""
    try:
        if files:
            validate_settings(config.agents.settings)
    except SettingsError as exc:
        where = f" (in {config.source})" if config.source else ""
        raise ConfigError(f"{exc.key}{where}: {str(exc)[len(exc.key) + 2:]}", key=exc.key) from None
    _check_config_range(config, "agents.max_processes", config.agents.max_processes)
    _check_config_range(config, "agents.quiet_warning_s", config.agents.quiet_warning_s)
    _check_config_range(config, "agents.turn_timeout_s", config.agents.turn_timeout_s)
    bound = config.agents.max_memory
    if bound is not None and not memory.in_range(bound):
        raise Where("agents.max_memory", config.origins.get("agents.max_memory")).error(
            config.given.get("agents.max_memory", str(bound)), "is out of range", memory.accepted())


def agent_memory_bound(config: Config, agent: str) -> int:
    """The memory bound of agent ``agent`` in bytes: its ``[agents.NAME] max_memory``, else
    ``agents.max_memory``, else half the host's RAM."""
    settings = config.agents.settings.get(agent)
    if settings is not None and settings.max_memory is not None:
        return settings.max_memory
    return config.agents.max_memory if config.agents.max_memory is not None else memory.default_bound()


def validate_network(config: Config) -> None:
    """Check ``[network]``: every ``allow_hosts`` rule and ``host_ports`` entry (Issue 44 scenario F);
    the refusal names the key, the value as given and why. ``mode`` is checked as it is read, and
    ``[agents.NAME]``'s ``network`` and ``allow_hosts`` by ``daemon.agents.settings``."""
    n = config.network
    for key, values, parse in (("network.allow_hosts", n.allow_hosts, parse_host_rule),
                               ("network.host_ports", n.host_ports, parse_host_port)):
        for value in values:
            try:
                parse(value)
            except RuleError as exc:
                raise Where(key, config.origins.get(key)).error(
                    config.given.get(key, json.dumps(list(values))), f"has an entry refused: {exc}") from None


def _refuse(config: Config, key: str, value: Any, problem: str) -> ConfigError:
    return Where(key, config.origins.get(key)).error(config.given.get(key, render_value(value)), problem)


def validate_cluster(config: Config, files: bool = True) -> None:
    """Check ``[cluster]`` and ``database.password_file`` (Issue 47): the host name's syntax, the
    heartbeat and timeout ranges and their rule, a cluster only on PostgreSQL; the password file
    like a ``secret_env`` file unless not ``files``. Each refusal names key, value and range."""
    c = config.cluster
    _check_config_range(config, "cluster.heartbeat_s", c.heartbeat_s)
    _check_config_range(config, "cluster.host_timeout_s", c.host_timeout_s)
    if c.host_timeout_s < HEARTBEATS_PER_TIMEOUT * c.heartbeat_s:
        raise _refuse(config, "cluster.host_timeout_s", c.host_timeout_s,
                      f"is less than {HEARTBEATS_PER_TIMEOUT} heartbeats (cluster.heartbeat_s = {c.heartbeat_s},"
                      f" so at least {HEARTBEATS_PER_TIMEOUT * c.heartbeat_s})")
    if c.host is not None:
        if not HOST_NAME.fullmatch(c.host):
            raise _refuse(config, "cluster.host", c.host, "is not a host name")
        url = config.database.url
        if url is None or not url.startswith("postgresql"):
            raise _refuse(config, "cluster.host", c.host,
                          "needs a PostgreSQL database.url (a cluster shares one PostgreSQL database; SQLite"
                          " serves one host)")
    ref = config.database.password_file
    if ref is not None:
        try:
            parsed = SecretRef.parse(ref, "database.password_file")
            if files and parsed.kind is SecretKind.FILE:
                check_secret_file(parsed.target, variable="PASSWORD")
        except SettingsError as exc:
            raise _refuse(config, "database.password_file", ref,
                          f"is refused: {str(exc)[len(exc.key) + 2:]}") from None
        except KeyFileError as exc:
            raise _refuse(config, "database.password_file", ref, f"is refused: {exc}; fix: {exc.fix}") from None


def validate_backend(config: Config, files: bool = True) -> None:
    """Check the keys the backend reads (AC-EXECUTORS-SURVIVAL-002.13, AC-EXECUTORS-SURVIVAL-003.7; credentials; agents; network; cluster)."""
    validate_credentials(config)
    validate_agents(config, files)
    validate_network(config)
    validate_cluster(config, files)
    if config.store.transcript_retention is not None:
        _check_config_range(config, "store.transcript_retention", config.store.transcript_retention)
    a = config.agentctl

    def where(key: str) -> Where:
        return Where(f"agentctl.{key}", config.origins.get(f"agentctl.{key}"))

    d, t, r = a.recovery_deadline, a.recovery_read_timeout, a.recovery_read_retries
    _check_config_range(config, "agentctl.recovery_deadline", d)
    _check_config_range(config, "agentctl.recovery_read_timeout", t)
    _check_config_range(config, "agentctl.recovery_read_retries", r)
    budget, ceiling = t * (r + 1), min(READ_BUDGET_CAP, d / 5)
    if budget > ceiling + EPSILON:
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


def check_config(config_file: str | None, env: Mapping[str, str] | None = None, *, files: bool = True) -> Config:
    """What the backend checks at start (``kandev up`` and ``kandev doctor`` check the same, before
    starting anything): the file and the environment, the backend's keys, the control server's;
    the agents' key files too unless not ``files`` (``kandev doctor`` lists each of them apart)."""
    config = load_config(config_file, env)
    validate_backend(config, files)
    a = config.agentctl
    validate_agentctl(a.detached_event_limit, a.unowned_period, a.idle_timeout, origins=config.origins)
    return config


def agentctl_settings(config: Config) -> dict[str, str]:
    """The control server's keys as strings to hand to it (arguments or ``Environment=``)."""
    a = config.agentctl
    return {
        "detached_event_limit": str(a.detached_event_limit),
        "unowned_period": format_duration(a.unowned_period),
        "idle_timeout": format_duration(a.idle_timeout),
    }


def agent_network(config: Config, name: str) -> NetworkPolicy:
    """The network of agent ``name`` under ``config`` (``daemon.agents.network``): its mode
    (``[agents.NAME] network``, else ``[network] mode``), its built-in provider hosts, then
    ``[network] allow_hosts`` and ``[agents.NAME] allow_hosts``, and ``[network] host_ports``. The
    values were checked at start (``validate_network``, ``daemon.agents.settings``)."""
    agent = BUILTIN_AGENTS.get(name)
    settings = config.agents.settings.get(name)
    mode = (settings.network if settings is not None else None) or config.network.mode
    hosts = [*config.network.allow_hosts, *(settings.allow_hosts if settings is not None else ())]
    return effective_policy(mode, hosts, config.network.host_ports, name, agent.allow_hosts if agent else ())
