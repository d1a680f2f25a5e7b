"""Each config key is declared once (daemon/config/keys.py ``SETTINGS``: type, default, range, doc) and
everything else agrees with that declaration: the section dataclasses, the refusals, and the
README's configuration table, which must be exactly the generated one (Issue 13 item 3)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon.config import agentctl as config_agentctl
from daemon.config import keys as config_keys
from daemon.config import settings as cfg
from daemon.config.keys import SECTIONS, SETTING, SETTINGS, ConfigError, Kind
from daemon.config.settings import SECTION_TYPES, TABLE_FIELDS, Config, load_config

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def _no_system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cfg, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")


def _readme_table() -> str:
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index("| key | default | accepted |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end]) + "\n"


def test_readme_configuration_table_is_the_generated_one() -> None:
    expected = config_keys.markdown_table()
    assert _readme_table() == expected, (
        "README.md's configuration table differs from daemon/config/keys.py SETTINGS; replace it with:\n" + expected
    )


def test_the_readme_check_fails_when_a_declaration_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: a changed default shows in the generated table."""
    changed = dataclasses.replace(SETTING["agentctl.recovery_deadline"], default=45.0)
    monkeypatch.setattr(config_keys, "SETTINGS", tuple(changed if s.key == changed.key else s for s in SETTINGS))
    assert "| `agentctl.recovery_deadline` | `45s` |" in config_keys.markdown_table()
    assert config_keys.markdown_table() != _readme_table()


def test_every_section_dataclass_has_exactly_the_declared_keys_with_the_declared_defaults() -> None:
    assert set(SECTION_TYPES) == set(SECTIONS)
    assert {f.name for f in dataclasses.fields(Config)} >= set(SECTIONS)
    for section, keys in SECTIONS.items():
        fields = {f.name: f.default for f in dataclasses.fields(SECTION_TYPES[section])
                  if f.name not in TABLE_FIELDS.get(section, ())}
        assert set(fields) == set(keys), section
        for key in keys:
            assert fields[key] == SETTING[f"{section}.{key}"].default, f"{section}.{key}"
    assert load_config(None, {}) == Config()


def test_every_declaration_is_complete() -> None:
    assert len(SETTING) == len(SETTINGS)
    for s in SETTINGS:
        assert s.accepts() and (s.doc or s.low is not None), s.key
        assert (s.kind is Kind.CHOICE) == bool(s.choices), s.key
        if s.default is not None and s.low is not None:
            assert s.in_range(s.default), f"{s.key}: the default is out of its own range"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.low is not None], ids=lambda s: s.key)
def test_a_value_below_the_declared_range_is_refused_naming_key_value_and_range(setting) -> None:
    """Out of range is refused at start, never clamped; the message names key, value and range."""
    if setting.kind is Kind.INT:
        value, given = str(int(setting.low) - 1), str(int(setting.low) - 1)
    else:
        value = given = config_keys.format_duration(setting.low - 0.05) if setting.low > 0 else "-1s"
    env = {setting.env_var: value}
    with pytest.raises(ConfigError) as err:
        c = load_config(None, env)
        if setting.section == "agentctl" and setting.name in ("detached_event_limit", "unowned_period"):
            config_agentctl.validate_agentctl(value if setting.name == "detached_event_limit" else 100,
                                  value if setting.name == "unowned_period" else "10min", "1h",
                                  origins={setting.key: f"env {setting.env_var}"})
        else:
            cfg.validate_backend(c)
    message = str(err.value)
    assert setting.key in message and given in message and setting.accepts() in message, message
    assert err.value.key == setting.key
