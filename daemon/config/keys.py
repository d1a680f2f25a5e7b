"""The declaration of every operator setting, and how a value is written.

Every key is declared once, in ``SETTINGS``: its type (``Kind``), default, accepted range and the
line the README's configuration table shows (``markdown_table`` generates it; a unit test checks
it). This module also owns the syntax of one value: durations with a unit (``parse_duration``,
``format_duration``), the conversion of a value as written to its type (``convert``), and the
refusal that names key, value and what is accepted (``ConfigError``, built by ``Where.error``;
``check_range`` for the declared bounds). Reading the file and the environment is
``daemon.config.settings``; the control server's keys at its start are ``daemon.config.agentctl``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from enum import Enum
from typing import Any

from daemon.agents import memory

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
QUIET_WARNING_MIN, QUIET_WARNING_MAX = 1, 3600  # seconds (agents.quiet_warning_s)
TURN_TIMEOUT_MAX = 7 * 24 * 3600  # seconds (agents.turn_timeout_s; 0: off)
HEARTBEAT_MIN, HEARTBEAT_MAX = 1, 60  # seconds (cluster.heartbeat_s)
HOST_TIMEOUT_MIN, HOST_TIMEOUT_MAX = 3, 600  # seconds (cluster.host_timeout_s)
HEARTBEATS_PER_TIMEOUT = 3  # cluster.host_timeout_s >= 3 x cluster.heartbeat_s
HOST_NAME = re.compile(r"[A-Za-z0-9-]{1,63}")  # cluster.host (fullmatch)
DEFAULT_GITHUB_URL = "https://github.com"
DEFAULT_PUSH_REFS = ("refs/heads/*", "!@default")  # every branch except the repository's default branch
EPSILON = 1e-9  # float slack for "<=" between sums of parsed durations

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
    LIST = "list"  # a list of non-empty strings, possibly empty (from the environment: comma-separated)
    CHOICE = "choice"  # one of ``Setting.choices``
    BYTES = "bytes"  # a size: bytes, or a number with K, M, G or T (``daemon.agents.memory``)


@dataclass(frozen=True)
class Setting:
    """One operator setting, declared once: its type, default, accepted range and documentation.

    ``low``/``high`` are inclusive bounds (seconds for durations) checked by the daemon that reads
    the key, at its start; ``accepted`` is what a refusal quotes (derived from the kind and the
    bounds when left empty; ``note`` is added inside its parentheses); ``doc`` is the README's
    "accepted" column (``accepted`` when left empty). ``secret``: the value as given is never
    repeated (it may hold a password).

    Adding a key: one ``Setting`` in ``SETTINGS``, a field of the same name in its section's
    dataclass in ``daemon.config.settings`` (default ``_default(key)``), the range check in the
    ``validate_*`` function of the daemon that reads it, a commented line in
    packaging/etc/kandev.toml; then regenerate the README's table (``markdown_table``). A new
    section also needs its dataclass in ``daemon.config.settings.SECTION_TYPES`` and a field in ``Config``.
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
        return low - EPSILON <= value <= high + EPSILON

    def default_text(self) -> str:
        """The default as the README's table shows it."""
        if self.default is None:
            return "unset"
        if self.kind in (Kind.DURATION, Kind.DURATION_OR_ZERO):
            return f"`{format_duration(self.default)}`"
        return f"`{render_value(self.default)}`"


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
NETWORK_MODES = ("allow-list", "none", "open")  # daemon.agents.network.MODES

SETTINGS: tuple[Setting, ...] = (
    Setting("features.agent_survival", Kind.BOOL, False,
            "`true`/`false`; takes effect at the next backend start", accepted="true or false"),
    Setting("features.auto_resume", Kind.BOOL, True,
            "`true`/`false`; at start, after recovery, resume the sessions the restart interrupted"
            " (their agents did not survive it); sessions that had no agent are left as they are",
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
            " beside an SQLite file outside the home; a session advisory lock on PostgreSQL); in a cluster"
            " (`cluster.host`) one backend per host name",
            accepted="a non-empty SQLAlchemy URL; leave it unset for SQLite at <home>/kandev.db", secret=True),
    Setting("database.password_file", Kind.STR, None,
            "where the PostgreSQL password is: an absolute path of a file (checked like a `secret_env` file:"
            " regular, no symlink, mode 0600/0640/0400/0440, owner root or the service user) or"
            " `\"credential:NAME\"` (a systemd credential of `kandev-backend.service`); joined to `database.url`"
            " when connecting, never logged; unset: the URL alone (peer authentication)",
            accepted='an absolute path to a 0600 file holding the database password, or "credential:NAME"'),
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
    Setting("agents.quiet_warning_s", Kind.INT, 30,
            "seconds a running turn may go without any output from its agent before `kandev follow`,"
            " `kandev board` and `kandev session show` say `waiting for the agent: no output for N s`,"
            " with a hint (its log, the provider address it was given, how to cancel); again every as many"
            " seconds after. Whole number 1..3600",
            low=QUIET_WARNING_MIN, high=QUIET_WARNING_MAX),
    Setting("agents.turn_timeout_s", Kind.INT, 0,
            "seconds without any output from its agent after which a running turn is cancelled and ends"
            " with stop reason `timeout` (an agent that ignores that cancel is stopped as long again later,"
            " 5 minutes at most); `0` (the default) never ends a turn for its silence;"
            " whole number 0..604800 (7 days)",
            low=0, high=TURN_TIMEOUT_MAX, note="0: off"),
    Setting("agents.max_memory", Kind.BYTES, None,
            "the memory one agent (with everything it starts) may use: bytes, or a number with `K`, `M`, `G`"
            " or `T` (`\"8G\"`); unset: half the host's RAM; at least `64M`, at most the host's RAM. Each agent"
            " runs in a memory cgroup of its own with this bound: the kernel kills the agent alone when it goes"
            " over (`agent_killed`, reason `memory`); `[agents.NAME] max_memory` sets it for one agent",
            accepted=("bytes, or a number with K, M, G or T (e.g. \"8G\"), from 64M to this host's RAM;"
                      " unset: half the host's RAM")),
    Setting("cluster.host", Kind.STR, None,
            "this backend's host name in a cluster (letters, digits and `-`, 1..63 characters, unique per"
            " database): with a PostgreSQL `database.url`, several hosts share one board and each drives"
            " its own sessions (docs/cluster.md); unset: a single host. Refused with SQLite",
            accepted="letters, digits and -, 1..63 characters, with a PostgreSQL database.url; unset: a single host"),
    Setting("cluster.heartbeat_s", Kind.INT, 5,
            "seconds between two heartbeats of this host in the cluster's table of hosts; whole number 1..60",
            low=HEARTBEAT_MIN, high=HEARTBEAT_MAX),
    Setting("cluster.host_timeout_s", Kind.INT, 30,
            "seconds without a heartbeat after which a host is shown `unreachable` (its sessions' last known"
            " state is marked so, never shown live); whole number 3..600, at least 3 x `cluster.heartbeat_s`",
            low=HOST_TIMEOUT_MIN, high=HOST_TIMEOUT_MAX, note="at least 3 x cluster.heartbeat_s"),
    Setting("network.mode", Kind.CHOICE, "allow-list",
            '`"allow-list"`: every sandboxed agent reaches, through its session\'s egress proxy, only its'
            " provider's hosts (`kandev agents`) and `allow_hosts`; `\"open\"`: any public address;"
            " `\"none\"`: no network at all (no proxy). Private addresses (loopback, RFC 1918, link-local,"
            " CGNAT, ULA, multicast) are refused in every mode unless listed in `host_ports`;"
            " `[agents.NAME] network` overrides the mode for one agent",
            choices=NETWORK_MODES,
            accepted='"allow-list" (the agent\'s provider hosts and allow_hosts), "open" (any public address)'
                     ' or "none" (no network)'),
    Setting("network.allow_hosts", Kind.LIST, (),
            'hosts every agent may reach in the allow-list mode, added to each agent\'s built-in ones and its'
            ' `[agents.NAME] allow_hosts`: a name (`"pypi.org"`), a glob of the first label'
            ' (`"*.example.com"`) or an address, optionally with `:port` (without: 443 and 80)',
            accepted='a list of host names, "*.domain" globs or addresses, each optionally ":port",'
                     ' e.g. ["pypi.org", "*.example.com:8443"]'),
    Setting("network.host_ports", Kind.LIST, (),
            'private destinations agents may reach, each an exact address and port, e.g.'
            ' `["127.0.0.1:11434"]` (a local model server); a name that resolves to one is allowed only if'
            ' the name is allowed too',
            accepted='a list of "ADDRESS:PORT" with an IP address, e.g. ["127.0.0.1:11434", "[::1]:8080"]'),
)
RULES: tuple[Rule, ...] = (
    Rule("(read budget)", "agentctl.recovery_read_retries",
         "`recovery_read_timeout x (recovery_read_retries + 1) <= min(6 s, recovery_deadline / 5)`"),
    Rule("(host timeout)", "cluster.host_timeout_s", "`host_timeout_s >= 3 x heartbeat_s`"),
)
SETTING: dict[str, Setting] = {s.key: s for s in SETTINGS}
# section -> its keys, in declaration order
SECTIONS: dict[str, tuple[str, ...]] = {
    section: tuple(s.name for s in SETTINGS if s.section == section)
    for section in dict.fromkeys(s.section for s in SETTINGS)
}


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
    TableSetting("agents.NAME.network", "`network.mode`", 'that agent\'s network mode: `"allow-list"`, `"open"` or `"none"` (as `network.mode`, for this agent only)'),
    TableSetting("agents.NAME.allow_hosts", "`[]`", 'hosts that agent may reach besides its built-in ones (`kandev agents`) and `network.allow_hosts`, written as there'),
    TableSetting("agents.NAME.home_files", "`{}`", 'files copied into each session\'s HOME before every launch of that agent (start, resume, restart): `"path/relative/to/HOME" = "/absolute/host/file"` (at most 32; the host file checked like a `secret_env` file; the copy mode 0600, never through a symlink in the HOME), e.g. `{ ".config/opencode/opencode.json" = "/etc/kandev/agents/opencode.json" }`'),
    TableSetting("agents.NAME.max_memory", "`agents.max_memory`", "that agent's memory bound, written like `agents.max_memory` (e.g. `max_memory = \"2G\"`), from 64M to the host's RAM"),
)


def markdown_table() -> str:
    """The README's configuration table, generated from ``SETTINGS`` and ``RULES`` (a unit test
    checks README.md holds exactly this; print it with
    ``python -c 'from daemon.config.keys import markdown_table; print(markdown_table(), end="")'``)."""
    lines = ["| key | default | accepted |", "|---|---|---|"]
    for s in SETTINGS:
        lines.append(f"| `{s.key}` | {s.default_text()} | {s.doc or s.accepts()} |")
        lines.extend(f"| {r.label} | | {r.doc} |" for r in RULES if r.after == s.key)
    lines.extend(f"| `{t.key}` | {t.default} | {t.doc} |" for t in TABLE_SETTINGS)
    return "\n".join(lines) + "\n"


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


# ---------------------------------------------------------------- one value as written


def render_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return str(value)


class Where:
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


def convert(kind: Kind, value: Any, where: Where, *, text: bool) -> Any:
    """Type-check one value. ``text``: it came as a string (environment, argument), so "3" is 3."""
    given = render_value(value)
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
    if kind is Kind.BYTES:
        if isinstance(value, int | str) and not isinstance(value, bool):
            try:
                return memory.parse_bytes(value)
            except ValueError as e:
                raise where.error(given, str(e)) from None
        raise where.error(given, 'is not a size (write bytes, or a number with K, M, G or T: "8G")')
    if kind is Kind.CHOICE:
        if isinstance(value, str) and value.strip() in SETTING[where.key].choices:
            return value.strip()
        raise where.error(given, "is not one of the choices")
    if kind is Kind.LIST:
        items = ([v for v in value.split(",") if v.strip()] if text and isinstance(value, str) else value)
        if isinstance(items, list | tuple) and all(isinstance(v, str) and v.strip() for v in items):
            return tuple(v.strip() for v in items)
        raise where.error(given, "is not a list of non-empty strings")
    if kind is Kind.STR_LIST:
        items = value.split(",") if text and isinstance(value, str) else value
        if isinstance(items, list | tuple) and items and all(isinstance(v, str) and v.strip() for v in items):
            return tuple(v.strip() for v in items)
        raise where.error(given, "is not a non-empty list of non-empty strings")
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise where.error(given, "is not a non-empty string")


def check_range(key: str, value: float, given: str, origin: str | None) -> None:
    """Refuse ``value`` outside the declared bounds of ``key``, naming key, value and range."""
    if not SETTING[key].in_range(value):
        raise Where(key, origin).error(given, "is out of range")
