"""The configuration ``kandev doctor`` checks: which one, and what it gives the agents.

``configuration``: the running backend's (its ``config_show`` answer: the file it runs with, its
key files checked as its own user), unless ``--config`` names a file or no backend answers; then
that file, or the one ``kandev up`` would start one with, loaded and validated here (Issue 46
Why 3). The ``config`` check names the file and why that one. ``agent_checks``: each configured
agent's variable names and where its keys come from (never a value), then one failing check per
key file or ``home_files`` source that would refuse an agent's start, named by its key, with the
fix (Issue 46 Why 4).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from daemon.cli.config_read import BACKEND, HERE, described
from daemon.cli.human.views import configuration_line
from daemon.config.keys import ConfigError
from daemon.config.platform import Check
from daemon.config.settings import Config, check_config, config_file, load_config
from daemon.config.view import config_from_view, config_view


def _check(name: str, ok: bool, detail: str, hint: str | None = None) -> Check:
    return Check(name, ok, detail, None if ok else hint)


def configuration(backend_view: dict[str, Any] | None, config_path: str | None, env: Mapping[str, str]
                  ) -> tuple[Config | None, dict[str, Any] | None, list[Check]]:
    """The configuration to check (``backend_view``: the running backend's answer, None when none
    answered or ``--config`` was given), its view (``daemon.config.view``) and the ``config``
    check; None, None when the file is refused."""
    if backend_view is not None:
        view = described(backend_view, BACKEND, f"the running backend's, pid {backend_view.get('pid')}, as it"
                         " read it at its start; `kandev doctor --config FILE` checks another file")
        return config_from_view(view), view, [_check("config", True, configuration_line(view.get("file"),
                                                                                      view["reason"]))]
    reason = "--config" if config_path else "no backend answers for this home: the file `kandev up` would start one with"
    try:
        config = check_config(config_path, env, files=False)  # the agents' files: one check each
    except (ConfigError, OSError) as exc:
        return None, None, [_check("config", False, f"configuration refused: {exc}",
                                   f"fix the key named above in {config_file(config_path, env)} (or the KANDEV_*"
                                   " variable); the packaged /etc/kandev/kandev.toml lists every key with its"
                                   " default and range")]
    view = described(config_view(config), HERE, reason)
    return config, view, [_check("config", True, "configuration valid; " + configuration_line(config.source, reason))]


def agent_checks(view: dict[str, Any] | None) -> list[Check]:
    """``agents`` (what each configured agent gets) and one failing check per refused file."""
    if view is None:  # the configuration was refused: said by the config check
        return []
    checks = []
    where = view.get("file") or "the configuration (no file)"
    configured = view.get("configured") or []
    if not configured:
        checks.append(_check("agents", True, f"no [agents.NAME] settings in {where}: agents get no provider"
                             " settings or keys from kandev"))
    parts = []
    for name in configured:
        shown = view["agents"].get(name) or {"env": [], "secret_env": {}, "home_files": {}}
        secret = ", ".join(f"{var} ({ref})" for var, ref in shown["secret_env"].items())
        files = ", ".join(f"~/{dest} ({src})" for dest, src in shown["home_files"].items())
        parts.append(f"{name}: env {', '.join(shown['env']) or '-'}; secret_env {secret or '-'}"
                     + (f"; home_files {files}" if files else ""))
    if parts:
        checks.append(_check("agents", True, f"{where}: " + "; ".join(parts)))
    for problem in view.get("problems") or []:
        checks.append(_check(problem["key"], False, problem["what"], problem["fix"]))
    return checks


def database_url(file: str | None) -> str | None:
    """``database.url`` as the running backend's file gives it, read here (None: not readable here,
    or it came from the backend's environment)."""
    try:
        return load_config(file, {}).database.url if file else None
    except (ConfigError, OSError):
        return None
