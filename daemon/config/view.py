"""A configuration as one JSON object: what the running backend answers to ``config_show``, and
what ``kandev agents`` and ``kandev doctor`` read.

The inspection commands describe the configuration the running backend runs with (the file it
was started with, the ``KANDEV_*`` variables of its environment, as it parsed them at start), not
whatever file the shell that runs them would find; only ``--config FILE``, or no backend running,
makes them read a file themselves. Both ways give them the same object (``config_view``):

- ``file``: the file read (None: none, every key at its default or from the environment);
- ``settings``: every declared key's value (durations in seconds; a ``secret`` key's value is
  never in it, only whether one is set: ``HIDDEN``), and ``origins``: where each non-default
  value came from (the file, or ``env NAME``);
- ``agents``: every built-in agent's ``[agents.NAME]`` as ``kandev agents`` shows it (variable
  names, where each key comes from, the files copied into its HOME; never a value),
  ``configured``: the agents that have such a table, and ``networks``: each agent's network
  (its mode and the hosts it may reach: ``daemon.agents.network``);
- ``problems``: every configured key file or ``home_files`` source refused as the process that
  made the view sees it (``daemon.agents.file_checks``): a backend's view checks them as the
  service user, with the fix for each.

``config_from_view`` gives a ``Config`` back for the checks that need one (``doctor``): every
declared key but a hidden one (left at its default), and no ``[agents.NAME]`` tables (their
descriptions are in the view).
"""

from __future__ import annotations

from typing import Any

from daemon.agents.file_checks import file_problems
from daemon.agents.network import describe as describe_network
from daemon.agents.registry import BUILTIN_AGENTS
from daemon.agents.settings import describe
from daemon.config.keys import SECTIONS, SETTINGS
from daemon.config.settings import SECTION_TYPES, AgentsConfig, Config, agent_network

HIDDEN = "<hidden>"
"""A secret key's value in a view, when one is set."""


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def config_view(config: Config) -> dict[str, Any]:
    """``config`` as JSON (see the module docstring); the files are checked now."""
    settings: dict[str, Any] = {}
    for s in SETTINGS:
        value = getattr(getattr(config, s.section), s.name)
        settings[s.key] = HIDDEN if s.secret and value is not None else _plain(value)
    return {
        "file": config.source,
        "settings": settings,
        "origins": dict(config.origins),
        "agents": {name: describe(config.agents.settings, name) for name in sorted(BUILTIN_AGENTS)},
        "configured": sorted(config.agents.settings),
        "networks": {name: describe_network(agent_network(config, name)) for name in sorted(BUILTIN_AGENTS)},
        "problems": [p.as_dict() for p in file_problems(config.agents.settings)],
    }


def config_from_view(view: dict[str, Any]) -> Config:
    """The ``Config`` a view describes, without its hidden values and ``[agents.NAME]`` tables."""
    values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    given = view.get("settings") or {}
    for s in SETTINGS:
        if s.key not in given or given[s.key] == HIDDEN and s.secret:
            continue
        value = given[s.key]
        values[s.section][s.name] = tuple(value) if isinstance(value, list) else value
    return Config(
        **{section: SECTION_TYPES[section](**values[section]) for section in SECTIONS if section != "agents"},
        agents=AgentsConfig(**values["agents"]),
        source=view.get("file"),
        origins=dict(view.get("origins") or {}),
    )


def hidden(view: dict[str, Any], key: str) -> bool:
    """Whether the view holds a value for secret ``key`` that it does not show."""
    return bool((view.get("settings") or {}).get(key) == HIDDEN)
