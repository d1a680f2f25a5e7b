"""daemon.config.platform: each reason code with injected probes (docs/architecture.md#lifetimes).

AC-EXECUTORS-SURVIVAL-005.4: unavailable is reported distinctly from operator-disabled, with a reason,
whatever the switch says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from daemon.config.platform import (
    AGENTCTL_UNIT,
    Probes,
    cgroup_path,
    check_capability,
    innermost_unit,
    run_checks,
)
from daemon.config.settings import Config, FeaturesConfig

ON = Config(features=FeaturesConfig(agent_survival=True))
OFF = Config()
SERVICE_CGROUP = "0::/system.slice/kandev-backend.service\n"
USER_SERVICE_CGROUP = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/kandev-backend.service\n"
SESSION_CGROUP = "0::/user.slice/user-1000.slice/session-4.scope\n"


def _systemctl(
    load_state: str | None, calls: list[list[str]] | None = None
) -> Callable[[Sequence[str]], str | None]:
    def run(argv: Sequence[str]) -> str | None:
        if calls is not None:
            calls.append(list(argv))
        return load_state

    return run


def probes(**overrides: object) -> Probes:
    base = Probes(
        platform=lambda: "linux",
        systemd_booted=lambda: True,
        systemctl=_systemctl("loaded"),
        euid=lambda: 990,
        polkit_rules=lambda: ["/usr/share/polkit-1/rules.d/50-kandev.rules"],
        cgroup=lambda: SERVICE_CGROUP,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


UNDER_SYSTEMD = {"INVOCATION_ID": "abc"}


@pytest.mark.parametrize("config", [ON, OFF])
def test_ac_executors_survival_005_4_not_linux_whatever_the_switch(config: Config) -> None:
    s = check_capability(config, env={}, probes=probes(platform=lambda: "darwin"))
    assert (s.state, s.reason) == ("unavailable", "not_linux")
    assert "Linux" in s.detail


def test_enabled_under_systemd() -> None:
    calls: list[list[str]] = []
    s = check_capability(ON, env=UNDER_SYSTEMD, probes=probes(systemctl=_systemctl("loaded", calls)))
    assert (s.state, s.reason, s.supervisor, s.user_manager) == ("enabled", None, "systemd", False)
    assert calls == [["show", "-p", "LoadState", "--value", AGENTCTL_UNIT]]


def test_operator_disabled() -> None:
    s = check_capability(OFF, env=UNDER_SYSTEMD, probes=probes())
    assert (s.state, s.reason) == ("disabled", "operator_disabled")


@pytest.mark.parametrize("load_state", ["not-found", None, "masked"])
@pytest.mark.parametrize("config", [ON, OFF])
def test_ac_executors_survival_005_4_unit_missing(load_state: str | None, config: Config) -> None:
    s = check_capability(config, env=UNDER_SYSTEMD, probes=probes(systemctl=_systemctl(load_state)))
    assert (s.state, s.reason, s.supervisor) == ("unavailable", "unit_missing", "systemd")


def test_no_unit_control_without_root_or_polkit_rule() -> None:
    s = check_capability(ON, env=UNDER_SYSTEMD, probes=probes(polkit_rules=lambda: []))
    assert (s.state, s.reason) == ("unavailable", "no_unit_control")


def test_root_needs_no_polkit_rule() -> None:
    s = check_capability(ON, env=UNDER_SYSTEMD, probes=probes(polkit_rules=lambda: [], euid=lambda: 0))
    assert s.state == "enabled"


def test_user_manager_uses_systemctl_user_and_needs_no_polkit() -> None:
    calls: list[list[str]] = []
    p = probes(polkit_rules=lambda: [], cgroup=lambda: USER_SERVICE_CGROUP,
               systemctl=_systemctl("loaded", calls))
    s = check_capability(ON, env=UNDER_SYSTEMD, probes=p)
    assert (s.state, s.supervisor, s.user_manager) == ("enabled", "systemd", True)
    assert calls[0][0] == "--user"


def test_invocation_id_without_systemd_is_not_under_systemd() -> None:
    p = probes(systemd_booted=lambda: False, cgroup=lambda: "0::/\n")
    s = check_capability(ON, env=UNDER_SYSTEMD, probes=p)
    assert (s.state, s.supervisor) == ("enabled", "none")


def test_cgroup_kills_detached() -> None:
    """Started by some .service without $INVOCATION_ID and no agentctl unit: a detached server would die."""
    p = probes(systemctl=_systemctl("not-found"))
    s = check_capability(ON, env={}, probes=p)
    assert (s.state, s.reason) == ("unavailable", "cgroup_kills_detached")
    assert "kandev-backend.service" in s.detail


def test_cgroup_kills_detached_when_no_systemd_to_ask() -> None:
    s = check_capability(OFF, env={}, probes=probes(systemd_booted=lambda: False))
    assert (s.state, s.reason) == ("unavailable", "cgroup_kills_detached")


def test_service_cgroup_with_usable_unit_launches_through_it() -> None:
    s = check_capability(ON, env={}, probes=probes())
    assert (s.state, s.supervisor) == ("enabled", "systemd")


@pytest.mark.parametrize("cgroup", [SESSION_CGROUP, "0::/\n", "0::/system.slice/docker-1234.scope\n", None])
def test_detached_spawn_outside_service_cgroups(cgroup: str | None) -> None:
    """Session scope, container without systemd (cgroup namespace root), unreadable: detached works."""
    called: list[list[str]] = []
    p = probes(cgroup=lambda: cgroup, systemd_booted=lambda: False, systemctl=_systemctl(None, called))
    s = check_capability(ON, env={}, probes=p)
    assert (s.state, s.reason, s.supervisor) == ("enabled", None, "none")
    assert called == []


def test_run_checks_cover_the_decision() -> None:
    checks = {c.name: c for c in run_checks(ON, env=UNDER_SYSTEMD, probes=probes(polkit_rules=lambda: []))}
    assert checks["platform"].ok and checks["agentctl_unit"].ok
    assert not checks["unit_control"].ok and checks["unit_control"].hint
    assert not checks["capability"].ok and "no_unit_control" not in checks["capability"].detail
    assert checks["capability"].detail.startswith("unavailable:")
    checks = {c.name: c for c in run_checks(OFF, env={}, probes=probes(platform=lambda: "win32"))}
    assert not checks["platform"].ok and checks["feature_switch"].ok


def test_cgroup_parsing() -> None:
    v1 = "12:pids:/x\n1:name=systemd:/system.slice/foo.service\n"
    assert cgroup_path(v1) == "/system.slice/foo.service"
    assert cgroup_path("0::/a/b.scope\n1:name=systemd:/c\n") == "/a/b.scope"
    assert cgroup_path("") is None
    assert innermost_unit("/system.slice/foo.service/payload") == "foo.service"
    assert innermost_unit("/user.slice/user-1.slice/user@1.service/app.slice/x.scope") == "x.scope"
    assert innermost_unit("/") is None
