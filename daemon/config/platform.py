"""The platform check: can agent survival work on this host, and is it switched on?

Answers ``enabled``, ``disabled`` or ``unavailable`` with a stable reason code
and a sentence (docs/architecture.md#lifetimes). Availability wins over the switch: a host that
cannot support survival reports ``unavailable`` whatever the switch says, so
an operator can tell "unsupported here" from "switched off"
(AC-EXECUTORS-SURVIVAL-005.4; docs/architecture.md#lifetimes). Reason codes:

- ``not_linux``: only Linux is supported.
- ``unit_missing``: we run as a systemd service but ``kandev-agentctl.service``
  is not installed (``LoadState`` is not ``loaded``).
- ``no_unit_control``: we run as a service of the system manager, not as
  root, and no Kandev polkit rule is installed. This is a heuristic: the
  packaged rule (``*kandev*.rules`` in ``/usr/share/polkit-1/rules.d`` or
  ``/etc/polkit-1/rules.d``) is what lets the service user start and stop the
  unit; its presence is checked, not its content, and nothing is started to
  find out. Where those directories cannot be listed (Debian: 0700 polkitd),
  polkit is asked (``pkcheck``) about the inert action the rule also grants. A user manager (``user@UID.service``) controls its own units.
- ``cgroup_kills_detached``: no service manager launches us, but our cgroup is
  a systemd ``.service`` (not a scope), whose remaining processes are killed
  with it, and the agentctl unit is not available to escape it.
- ``operator_disabled``: available, but ``features.agent_survival`` is off.

"Under systemd" means ``$INVOCATION_ID`` is set and ``/run/systemd/system``
exists. Every probe of the host is a field of ``Probes`` so tests inject them.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from daemon.config.settings import Config

AGENTCTL_UNIT = "kandev-agentctl.service"
POLKIT_RULE_GLOBS = ("/usr/share/polkit-1/rules.d/*kandev*.rules", "/etc/polkit-1/rules.d/*kandev*.rules")
POLKIT_PROBE_ACTION = "org.kandev.agentctl-control-probe"
SYSTEMCTL_TIMEOUT = 5.0

State = Literal["enabled", "disabled", "unavailable"]
Supervisor = Literal["systemd", "none"]


@dataclass(frozen=True)
class CapabilityStatus:
    """``reason`` is a stable code (None when enabled); ``detail`` one sentence for humans.

    ``supervisor`` says how an enabled control server is launched: ``systemd``
    (its unit; ``user_manager`` means ``systemctl --user``) or ``none``
    (spawned detached).
    """

    state: State
    reason: str | None
    detail: str
    supervisor: Supervisor
    user_manager: bool = False


@dataclass(frozen=True)
class Check:
    """One line of ``kandev doctor``."""

    name: str
    ok: bool
    detail: str
    hint: str | None = None


def _systemctl(argv: Sequence[str]) -> str | None:
    """Run ``systemctl`` with direct argv; its stdout, or None if it failed or hung."""
    try:
        done = subprocess.run(
            ["systemctl", *argv], capture_output=True, text=True, timeout=SYSTEMCTL_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _read_cgroup() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _polkit_rules() -> list[str]:
    found = sorted(p for pattern in POLKIT_RULE_GLOBS for p in glob.glob(pattern))
    if found:
        return found
    # Debian's polkitd keeps both rules directories 0700 polkitd, so the service user cannot list
    # them. The packaged rule also grants it an inert probe action (org.kandev.policy): asking
    # polkit about that action tells whether the rule is loaded, without starting anything.
    try:
        done = subprocess.run(
            ["pkcheck", "--action-id", POLKIT_PROBE_ACTION, "--process", str(os.getpid())],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=SYSTEMCTL_TIMEOUT, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [f"polkit grants {POLKIT_PROBE_ACTION} (the kandev rule is loaded)"] if done.returncode == 0 else []


@dataclass(frozen=True)
class Probes:
    """How the host is observed; replace any field in tests."""

    platform: Callable[[], str] = lambda: sys.platform
    systemd_booted: Callable[[], bool] = lambda: os.path.isdir("/run/systemd/system")
    systemctl: Callable[[Sequence[str]], str | None] = _systemctl
    euid: Callable[[], int] = os.geteuid
    polkit_rules: Callable[[], list[str]] = _polkit_rules
    cgroup: Callable[[], str | None] = _read_cgroup


def cgroup_path(text: str | None) -> str | None:
    """Our cgroup from ``/proc/self/cgroup``: the v2 entry, else v1 ``name=systemd``."""
    if not text:
        return None
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    for hid, controllers, path in lines:
        if hid == "0" and controllers == "":
            return path
    for _, controllers, path in lines:
        if controllers == "name=systemd":
            return path
    return None


def innermost_unit(path: str | None) -> str | None:
    """The innermost ``.service`` or ``.scope`` component of a cgroup path."""
    for part in reversed((path or "").split("/")):
        if part.endswith((".service", ".scope")):
            return part
    return None


@dataclass
class _Findings:
    checks: list[Check] = field(default_factory=list)
    reason: str | None = None
    detail: str = ""
    supervisor: Supervisor = "none"
    user_manager: bool = False

    def add(self, name: str, ok: bool, detail: str, hint: str | None = None) -> None:
        self.checks.append(Check(name, ok, detail, hint))

    def unavailable(self, reason: str, detail: str) -> None:
        if self.reason is None:
            self.reason, self.detail = reason, detail


def _unit_problem(f: _Findings, probes: Probes, *, user: bool) -> str | None:
    """Why the agentctl unit cannot be used (a reason code), or None; records the checks."""
    scope = ["--user"] if user else []
    load = probes.systemctl([*scope, "show", "-p", "LoadState", "--value", AGENTCTL_UNIT])
    loaded = load == "loaded"
    f.add("agentctl_unit", loaded, f"{AGENTCTL_UNIT} LoadState is {load or 'unknown'}",
          None if loaded else f"install {AGENTCTL_UNIT} and run systemctl daemon-reload")
    if user or probes.euid() == 0:
        f.add("unit_control", True, "we may start the unit (root, or our own user manager)")
        control = True
    else:
        rules = probes.polkit_rules()
        control = bool(rules)
        f.add("unit_control", control,
              f"polkit rule found: {rules[0]}" if rules else "not root and no *kandev*.rules polkit rule",
              None if control else "install the kandev polkit rule so the service user may start the unit")
    if not loaded:
        return "unit_missing"
    return None if control else "no_unit_control"


_UNIT_DETAIL = {
    "unit_missing": f"{AGENTCTL_UNIT} is not installed.",
    "no_unit_control": f"The service user cannot start {AGENTCTL_UNIT} (not root, no kandev polkit rule).",
}


def _availability(f: _Findings, env: Mapping[str, str], probes: Probes) -> None:
    """Fill ``f`` with the checks and, if survival cannot work here, the reason."""
    system = probes.platform()
    linux = system.startswith("linux")
    f.add("platform", linux, f"platform is {system}", None if linux else "only Linux is supported")
    if not linux:
        f.unavailable("not_linux", f"Agent survival needs Linux; this host is {system}.")
        return
    cg = cgroup_path(probes.cgroup())
    unit = innermost_unit(cg)
    user = "/user@" in (cg or "")
    if env.get("INVOCATION_ID") and probes.systemd_booted():
        f.supervisor, f.user_manager = "systemd", user
        f.add("service_manager", True, f"running as systemd unit {unit or '?'} (cgroup {cg})")
        problem = _unit_problem(f, probes, user=user)
        if problem:
            f.unavailable(problem, _UNIT_DETAIL[problem])
        return
    f.add("service_manager", True, f"no service manager runs us (cgroup {cg or 'unknown'})")
    kills = bool(unit and unit.endswith(".service"))
    f.add("detached_survives", not kills,
          f"cgroup unit {unit} kills every process left in it when it stops" if kills
          else f"a detached process can outlive the backend (cgroup unit {unit or 'none'})")
    if not kills:
        return
    if probes.systemd_booted() and _unit_problem(f, probes, user=user) is None:
        f.supervisor, f.user_manager = "systemd", user
        return
    f.unavailable("cgroup_kills_detached",
                  f"Our cgroup {cg} belongs to {unit}, which would kill a detached control server with it,"
                  f" and {AGENTCTL_UNIT} is not available.")


def _evaluate(config: Config, env: Mapping[str, str], probes: Probes) -> tuple[CapabilityStatus, list[Check]]:
    f = _Findings()
    _availability(f, env, probes)
    switch = config.features.agent_survival
    f.add("feature_switch", True, f"features.agent_survival is {'on' if switch else 'off'}")
    if f.reason is not None:
        status = CapabilityStatus("unavailable", f.reason, f.detail, f.supervisor, f.user_manager)
    elif not switch:
        status = CapabilityStatus("disabled", "operator_disabled",
                                  "Agent survival is off: a backend stop ends the agents' running turns"
                                  " (kandev up --survival, or features.agent_survival = true, keeps them).",
                                  f.supervisor, f.user_manager)
    else:
        how = f"through {AGENTCTL_UNIT}" if f.supervisor == "systemd" else "as a detached process"
        status = CapabilityStatus("enabled", None, f"Agent survival is on; the control server runs {how}.",
                                  f.supervisor, f.user_manager)
    f.add("capability", status.state != "unavailable", f"{status.state}: {status.detail}")
    return status, f.checks


def check_capability(
    config: Config, *, env: Mapping[str, str] | None = None, probes: Probes | None = None
) -> CapabilityStatus:
    """The capability state for ``kandev status``, the start-up journal entry and ``STATUS=``."""
    return _evaluate(config, os.environ if env is None else env, probes or Probes())[0]


def run_checks(
    config: Config, *, env: Mapping[str, str] | None = None, probes: Probes | None = None
) -> list[Check]:
    """Every check ``check_capability`` makes, for ``kandev doctor``."""
    return _evaluate(config, os.environ if env is None else env, probes or Probes())[1]
