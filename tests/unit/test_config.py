"""daemon.config.settings: parsing, environment overrides, ranges, the read-budget cross-check, unowned period.

Requirement IDs: AC-EXECUTORS-SURVIVAL-001.8 (retention limit), AC-EXECUTORS-SURVIVAL-002.13 (read budget),
AC-EXECUTORS-SURVIVAL-003.7 (deadline); AC-EXECUTORS-CONTROL-OWNERSHIP-003.4, AC-EXECUTORS-CONTROL-OWNERSHIP-003.6, AC-EXECUTORS-CONTROL-OWNERSHIP-003.7 (unowned period).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import settings as cfg
from daemon.config.agentctl import resolve_unowned_period, validate_agentctl
from daemon.config.keys import ConfigError, format_duration, parse_duration
from daemon.config.settings import AgentctlConfig, Config, agentctl_settings, load_config, validate_backend


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kandev.toml"
    path.write_text(text)
    return str(path)


def _backend(**env: str) -> None:
    validate_backend(load_config(None, {f"KANDEV_AGENTCTL_{k.upper()}": v for k, v in env.items()}))


# ---------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30.0), ("10min", 600.0), ("1h", 3600.0), ("1.5s", 1.5), ("0s", 0.0)],
)
def test_duration_units(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["30", "10m", "1w", "s", "1 h", "abc", "", "1e3s", "0"])
def test_duration_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.1, 1.5, 45.0, 600.0, 5400.0, 1 / 3, 2.1, 1e-5, -1.0])
def test_format_duration_reads_back_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_format_duration_is_short() -> None:
    assert [format_duration(s) for s in (0, 0.5, 30, 600, 3600, 1800, 90)] == [
        "0s", "500ms", "30s", "10min", "1h", "30min", "90s",
    ]


# ---------------------------------------------------------------- loading


def test_defaults_without_file() -> None:
    c = load_config(None, {})
    assert c.source is None
    assert c.features.agent_survival is False
    a = c.agentctl
    assert (a.detached_event_limit, a.recovery_deadline, a.recovery_read_timeout) == (100, 30.0, 2.0)
    assert (a.recovery_read_retries, a.unowned_period, a.idle_timeout) == (2, 600.0, 3600.0)
    assert c.database.url is None
    validate_backend(c)  # the defaults sit exactly on the read-budget ceiling and pass


def test_explicit_missing_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"), {})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(None, {"KANDEV_CONFIG": str(tmp_path / "nope.toml")})


def test_file_values_and_env_override(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        '[features]\nagent_survival = true\n[agentctl]\nrecovery_read_retries = 1\nunowned_period = "5min"\n'
        '[database]\nurl = "postgresql://db/kandev"\n',
    )
    c = load_config(path, {})
    assert c.source == path and c.features.agent_survival is True
    assert c.agentctl.recovery_read_retries == 1 and c.agentctl.unowned_period == 300.0
    assert c.database.url == "postgresql://db/kandev"
    c = load_config(None, {"KANDEV_CONFIG": path, "KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "3",
                           "KANDEV_FEATURES_AGENT_SURVIVAL": "no"})
    assert c.agentctl.recovery_read_retries == 3 and c.features.agent_survival is False
    assert c.origins["agentctl.recovery_read_retries"] == "env KANDEV_AGENTCTL_RECOVERY_READ_RETRIES"


def test_other_kandev_variables_ignored() -> None:
    load_config(None, {"KANDEV_HOME": "/x", "KANDEV_RUN_ID": "r", "KANDEV_CONFIG_X": "1"})


@pytest.mark.parametrize(("value", "expected"), [
    ("true", True), ("1", True), ("yes", True), ("TRUE", True),
    ("false", False), ("0", False), ("no", False),
])
def test_env_booleans(value: str, expected: bool) -> None:
    assert load_config(None, {"KANDEV_FEATURES_AGENT_SURVIVAL": value}).features.agent_survival is expected


def test_env_boolean_refused() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"KANDEV_FEATURES_AGENT_SURVIVAL": "on"})
    assert str(e.value) == (
        'features.agent_survival (environment variable KANDEV_FEATURES_AGENT_SURVIVAL) = "on"'
        " is not a boolean: accepted true/false/1/0/yes/no"
    )
    assert e.value.env_var == "KANDEV_FEATURES_AGENT_SURVIVAL"


@pytest.mark.parametrize(("text", "needle"), [
    ('[agentctl]\nrecovery_deadlin = "30s"\n', "unknown setting agentctl.recovery_deadlin"),
    ('[agentctrl]\nrecovery_deadline = "30s"\n', "unknown setting agentctrl"),
    ('agent_survival = true\n', "agent_survival"),
    ('[features]\nagent_survival = "true"\n', 'features.agent_survival (in '),
    ('[agentctl]\ndetached_event_limit = 100.0\n', "is not a whole number"),
    ('[agentctl]\nrecovery_read_retries = true\n', "is not a whole number"),
    ('[agentctl]\nrecovery_deadline = 30\n', "is not a duration"),
    ('[agentctl]\nrecovery_deadline = "30"\n', "is not a duration"),
    ('[database]\nurl = ""\n', "is not a non-empty string"),
    ('[agentctl\n', "not valid TOML"),
])
def test_file_refusals(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        load_config(_file(tmp_path, text), {})
    assert needle in str(e.value)


def test_unknown_env_key_is_a_typo() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"KANDEV_AGENTCTL_RECOVERY_DEADLIN": "30s"})
    assert "KANDEV_AGENTCTL_RECOVERY_DEADLIN" in str(e.value)
    assert "did you mean KANDEV_AGENTCTL_RECOVERY_DEADLINE" in str(e.value)


def test_type_error_names_key_value_and_range(tmp_path: Path) -> None:
    path = _file(tmp_path, '[agentctl]\nrecovery_read_retries = "two"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, {})
    assert str(e.value) == (
        f'agentctl.recovery_read_retries (in {path}) = "two" is not a whole number:'
        " accepted 0..10 (whole number, inclusive)"
    )


# ---------------------------------------------------------------- backend keys


def test_message_format_exact() -> None:
    """AC-EXECUTORS-SURVIVAL-003.7: the refusal names the key, the value as given and the range."""
    c = Config(agentctl=AgentctlConfig(recovery_deadline=0.5), given={"agentctl.recovery_deadline": '"500ms"'})
    with pytest.raises(ConfigError) as e:
        validate_backend(c)
    assert str(e.value) == 'agentctl.recovery_deadline = "500ms" is out of range: accepted 1s..5min (inclusive)'


def test_env_origin_in_message() -> None:
    with pytest.raises(ConfigError) as e:
        _backend(recovery_deadline="500ms")
    assert str(e.value).startswith(
        'agentctl.recovery_deadline (environment variable KANDEV_AGENTCTL_RECOVERY_DEADLINE) = "500ms"'
    )
    assert e.value.key == "agentctl.recovery_deadline"


@pytest.mark.parametrize(("deadline", "ok"), [("999ms", False), ("1s", True), ("5min", True), ("301s", False)])
def test_ac_executors_survival_003_7_deadline_range(deadline: str, ok: bool) -> None:
    """AC-EXECUTORS-SURVIVAL-003.7: D accepted from 1 s to 5 min inclusive, rejected (not clamped) outside."""
    env = {"recovery_deadline": deadline, "recovery_read_timeout": "100ms", "recovery_read_retries": "0"}
    if ok:
        _backend(**env)
    else:
        with pytest.raises(ConfigError, match=r"out of range: accepted 1s\.\.5min \(inclusive\)"):
            _backend(**env)


@pytest.mark.parametrize(("timeout", "ok"), [("99ms", False), ("100ms", True), ("0.1s", True), ("2s", True)])
def test_ac_executors_survival_002_13_read_timeout_range(timeout: str, ok: bool) -> None:
    """AC-EXECUTORS-SURVIVAL-002.13: T >= 100 ms, rejected below."""
    if ok:
        _backend(recovery_read_timeout=timeout)
    else:
        with pytest.raises(ConfigError, match="out of range: accepted >= 100ms"):
            _backend(recovery_read_timeout=timeout)


@pytest.mark.parametrize(("retries", "ok"), [("-1", False), ("0", True), ("10", True), ("11", False)])
def test_ac_executors_survival_002_13_retries_range(retries: str, ok: bool) -> None:
    """AC-EXECUTORS-SURVIVAL-002.13: R a whole number 0..10, rejected outside."""
    env = {"recovery_read_retries": retries, "recovery_read_timeout": "100ms"}
    if ok:
        _backend(**env)
    else:
        with pytest.raises(ConfigError, match=r"out of range: accepted 0\.\.10"):
            _backend(**env)


def test_ac_executors_survival_002_13_retries_must_be_whole() -> None:
    with pytest.raises(ConfigError, match="is not a whole number"):
        _backend(recovery_read_retries="2.5")


def test_ac_executors_survival_002_13_cross_check_explains_default_ceiling() -> None:
    """AC-EXECUTORS-SURVIVAL-002.13: T x (R+1) <= min(6 s, D/5); with defaults any D < 30 s is rejected."""
    _backend(recovery_deadline="30s")
    with pytest.raises(ConfigError) as e:
        _backend(recovery_deadline="29s")
    text = str(e.value)
    assert "2s x 3 = 6s must be <= min(6s, recovery_deadline / 5) = min(6s, 29s / 5)" in text
    assert "any recovery_deadline below 30s is rejected" in text
    assert "KANDEV_AGENTCTL_RECOVERY_DEADLINE" in text


@pytest.mark.parametrize(("env", "ok"), [
    ({"recovery_deadline": "5min", "recovery_read_retries": "3"}, False),  # 8s > 6s cap
    ({"recovery_deadline": "5min", "recovery_read_timeout": "2001ms"}, False),  # 6.003s > 6s
    ({"recovery_deadline": "5min", "recovery_read_timeout": "3s", "recovery_read_retries": "1"}, True),
    ({"recovery_deadline": "10s", "recovery_read_timeout": "1s", "recovery_read_retries": "1"}, True),
    ({"recovery_deadline": "10s", "recovery_read_timeout": "1001ms", "recovery_read_retries": "1"}, False),
    ({"recovery_deadline": "1s", "recovery_read_timeout": "100ms", "recovery_read_retries": "1"}, True),
    ({"recovery_deadline": "1s", "recovery_read_timeout": "100ms", "recovery_read_retries": "2"}, False),
])
def test_ac_executors_survival_002_13_cross_check_boundaries(env: dict[str, str], ok: bool) -> None:
    if ok:
        _backend(**env)
    else:
        with pytest.raises(ConfigError, match="read budget"):
            _backend(**env)


# ---------------------------------------------------------------- control-server keys


@pytest.mark.parametrize(("limit", "ok"), [
    (0, False), (1, True), (100, True), (10000, True), (10001, False), (-5, False),
    ("1", True), ("10000", True), ("0", False), ("10001", False), ("1.5", False), ("abc", False),
    ("100.0", False), (True, False), (1.0, False),
])
def test_ac_executors_survival_001_8_event_limit(limit: int | str, ok: bool) -> None:
    """AC-EXECUTORS-SURVIVAL-001.8: whole numbers 1..10000 only; anything else refused, never clamped."""
    if ok:
        assert validate_agentctl(limit, 600.0, 3600.0).detached_event_limit == int(limit)
    else:
        with pytest.raises(ConfigError) as e:
            validate_agentctl(limit, 600.0, 3600.0)  # type: ignore[arg-type]
        assert str(e.value).startswith("agentctl.detached_event_limit = ")
        assert "accepted 1..10000 (whole number, inclusive)" in str(e.value)


def test_ac_executors_survival_001_8_limit_from_file_not_whole(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="detached_event_limit .* is not a whole number"):
        load_config(_file(tmp_path, "[agentctl]\ndetached_event_limit = 1.5\n"), {})


def test_ac_executors_survival_001_8_env_origin_kept() -> None:
    c = load_config(None, {"KANDEV_AGENTCTL_DETACHED_EVENT_LIMIT": "0"})
    with pytest.raises(ConfigError) as e:
        validate_agentctl(c.agentctl.detached_event_limit, 600.0, 3600.0, origins=c.origins)
    assert e.value.env_var == "KANDEV_AGENTCTL_DETACHED_EVENT_LIMIT"


@pytest.mark.parametrize(("period", "ok"), [("24h", True), ("1440min", True), ("86401s", False), ("25h", False),
                                            ("-1s", False), ("0s", True)])
def test_unowned_period_upper_bound(period: str, ok: bool) -> None:
    """The unowned period is rejected above 24 h (docs/architecture.md#ownership); low values go to the floor."""
    if ok:
        validate_agentctl(100, period, "0")
    else:
        with pytest.raises(ConfigError, match=r"agentctl.unowned_period = .* accepted 0s\.\.24h"):
            validate_agentctl(100, period, "0")


def test_ac_executors_control_ownership_003_4_halved_below_idle_timeout() -> None:
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.4: period >= idle timeout (reaping on) -> idle/2, recorded."""
    r = validate_agentctl(100, "2h", "1h")
    assert r.unowned_period == 1800.0
    assert len(r.notes) == 1 and "AC-EXECUTORS-CONTROL-OWNERSHIP-003.4" in r.notes[0] and "30min" in r.notes[0]
    assert resolve_unowned_period(3600.0, 3600.0)[0] == 1800.0  # equal is "not shorter"
    assert resolve_unowned_period(600.0, 3600.0) == (600.0, [])


@pytest.mark.parametrize("idle", ["0", "0s", "-1s", 0, -5.0])
def test_ac_executors_control_ownership_003_6_sentinel_keeps_period(idle: str | float) -> None:
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.6: reaping disabled -> period unchanged, never derived from idle."""
    r = validate_agentctl(100, "10h", idle)
    assert r.unowned_period == 36000.0 and r.notes == []
    assert r.idle_timeout <= 0


def test_ac_executors_control_ownership_003_6_sentinel_from_config(tmp_path: Path) -> None:
    c = load_config(_file(tmp_path, "[agentctl]\nidle_timeout = 0\n"), {})
    assert c.agentctl.idle_timeout == 0.0
    assert load_config(None, {"KANDEV_AGENTCTL_IDLE_TIMEOUT": "0"}).agentctl.idle_timeout == 0.0
    with pytest.raises(ConfigError, match="is not a duration"):
        load_config(_file(tmp_path, "[agentctl]\nidle_timeout = 5\n"), {})


def test_ac_executors_control_ownership_003_7_floor() -> None:
    """AC-EXECUTORS-CONTROL-OWNERSHIP-003.7: effective period at least 1 min, raised and recorded."""
    r = validate_agentctl(100, "30s", "1h")
    assert r.unowned_period == 60.0
    assert len(r.notes) == 1 and "floor" in r.notes[0] and "AC-EXECUTORS-CONTROL-OWNERSHIP-003.7" in r.notes[0]
    r = validate_agentctl(100, "10s", "0")  # floor applies with reaping disabled too
    assert r.unowned_period == 60.0 and len(r.notes) == 1


def test_ac_executors_control_ownership_003_7_floor_after_halving() -> None:
    """The floor is applied after the AC-EXECUTORS-CONTROL-OWNERSHIP-003.4 adjustment and wins over it; ordering still met here."""
    period, notes = resolve_unowned_period(120.0, 90.0)
    assert period == 60.0
    assert len(notes) == 2 and "AC-EXECUTORS-CONTROL-OWNERSHIP-003.4" in notes[0] and "AC-EXECUTORS-CONTROL-OWNERSHIP-003.7" in notes[1]


@pytest.mark.parametrize("idle", [60.0, 30.0])
def test_ac_executors_control_ownership_003_7_ordering_cannot_be_met(idle: float) -> None:
    """Idle timeout so short no value meets floor and ordering: use the floor, record it, start anyway."""
    period, notes = resolve_unowned_period(600.0, idle)
    assert period == 60.0
    assert any("cannot be met" in n for n in notes)


def test_agentctl_settings_hand_over_and_read_back() -> None:
    c = load_config(None, {"KANDEV_AGENTCTL_UNOWNED_PERIOD": "90s", "KANDEV_AGENTCTL_IDLE_TIMEOUT": "0"})
    s = agentctl_settings(c)
    assert s == {"detached_event_limit": "100", "unowned_period": "90s", "idle_timeout": "0s"}
    r = validate_agentctl(s["detached_event_limit"], s["unowned_period"], s["idle_timeout"])
    assert (r.detached_event_limit, r.unowned_period, r.idle_timeout, r.notes) == (100, 90.0, 0.0, [])


# ---------------------------------------------------------------- agents.sandbox (Issue 10)


def test_agents_sandbox_defaults_to_required_and_accepts_off(tmp_path: Path) -> None:
    assert load_config(None, {}).agents.sandbox == "required"
    assert load_config(_file(tmp_path, '[agents]\nsandbox = "off"\n'), {}).agents.sandbox == "off"
    assert load_config(None, {"KANDEV_AGENTS_SANDBOX": "off"}).agents.sandbox == "off"


@pytest.mark.parametrize("value", ['"maybe"', "true", '"OFF"', '""'])
def test_agents_sandbox_refuses_anything_else_naming_key_value_and_accepted(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_file(tmp_path, f"[agents]\nsandbox = {value}\n"), {})
    message = str(info.value)
    assert "agents.sandbox" in message and value in message and '"required"' in message and '"off"' in message
    with pytest.raises(ConfigError, match="KANDEV_AGENTS_SANDBOX"):
        load_config(None, {"KANDEV_AGENTS_SANDBOX": "sometimes"})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(None, {"KANDEV_AGENTS_SANDBOXED": "off"})
