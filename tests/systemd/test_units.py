"""The shipped unit files (units/*.service) as a real systemd 252 loads them, inside a sdbox.

Nothing here starts a daemon: these tests prove what the unit files make systemd do (or not do)
to the control server when the backend stops, restarts or crashes (docs/architecture.md#lifetimes, docs/architecture.md#lifetimes).
The end-to-end scenarios live in their own modules and use the same `sdbox` fixture.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.sdbox import SdBox

BACKEND = "kandev-backend.service"
AGENTCTL = "kandev-agentctl.service"
UNITS_DIR = Path(__file__).resolve().parents[2] / "units"


@pytest.fixture(scope="module")
def units(sdbox: SdBox) -> list[str]:
    names = sdbox.install_units(UNITS_DIR, sdbox.venv_bin)
    assert set(names) >= {BACKEND, AGENTCTL}, names
    return names


def _unit_list(box: SdBox, unit: str, prop: str) -> set[str]:
    return set(box.prop(unit, prop).split())


def test_both_units_load(sdbox: SdBox, units: list[str]) -> None:
    """systemd parses both files without errors, from /etc/systemd/system, with ExecStart pointing at
    the dev venv's console scripts (the harness's /usr/bin/kandev rewrite)."""
    for unit, exe in ((BACKEND, "kandev-backend"), (AGENTCTL, "kandev-agentctl")):
        assert sdbox.prop(unit, "LoadState") == "loaded", sdbox.systemctl("status", unit, check=False).stdout
        assert sdbox.prop(unit, "LoadError") == ""
        assert sdbox.prop(unit, "FragmentPath") == f"/etc/systemd/system/{unit}"
        assert f"path={sdbox.venv_bin}/{exe} " in sdbox.prop(unit, "ExecStart")
        # nothing is started by loading
        assert sdbox.prop(unit, "ActiveState") == "inactive"


def test_systemd_analyze_verify_is_clean(sdbox: SdBox, units: list[str]) -> None:
    """`systemd-analyze verify` reports nothing about our units: no unknown or misspelt directive,
    no unparsable value, ExecStart executable. Lines about other units would be outside our control
    and are tolerated; on this systemd 252 there are none (the output is empty)."""
    paths = [f"/etc/systemd/system/{u}" for u in (BACKEND, AGENTCTL)]
    p = sdbox.run("systemd-analyze", "verify", *paths, check=False)
    ours = [line for line in (p.stdout + p.stderr).splitlines() if "kandev-" in line]
    assert p.returncode == 0 and not ours, p.stdout + p.stderr


def test_systemd_analyze_verify_catches_mistakes(sdbox: SdBox, units: list[str]) -> None:
    """Control for the test above: verify really flags a bad directive value, an unknown key and a
    missing ExecStart binary in this box, so its silence about our units means something."""
    path = "/etc/systemd/system/kandev-verify-control.service"
    sdbox.write_file(path, "[Service]\nType=notify\nKillMode=bogus\nFrobnicate=yes\n"
                     "ExecStart=/nonexistent/kandev\n")
    try:
        p = sdbox.run("systemd-analyze", "verify", path, check=False)
    finally:
        sdbox.run("rm", "-f", path)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "kill mode" in out and "Frobnicate" in out and "/nonexistent/kandev" in out, out


def test_both_are_type_notify_main_process_only(sdbox: SdBox, units: list[str]) -> None:
    """Readiness is READY=1 from the daemon itself (the startup order of docs/architecture.md#backend-startup ends with READY=1),
    and no child (e.g. an agent) may send notifications for the unit."""
    for unit in (BACKEND, AGENTCTL):
        assert sdbox.prop(unit, "Type") == "notify"
        assert sdbox.prop(unit, "NotifyAccess") == "main"


def test_killmode_control_group_on_both(sdbox: SdBox, units: list[str]) -> None:
    """`systemctl stop kandev-agentctl` stops every agent (docs/architecture.md#lifetimes); a backend stop or crash
    kills whatever runs in the backend's own cgroup. Never process/none."""
    for unit in (BACKEND, AGENTCTL):
        assert sdbox.prop(unit, "KillMode") == "control-group"


def test_agentctl_not_bound_to_backend(sdbox: SdBox, units: list[str]) -> None:
    """Kill path 3 of docs/architecture.md#lifetimes: no dependency lets a backend stop/restart/crash propagate to
    the control server. Checked from both ends, as systemd resolved the dependency graph."""
    for prop in ("PartOf", "BindsTo", "Requisite", "Requires", "PropagatesStopTo", "StopPropagatedFrom"):
        assert BACKEND not in _unit_list(sdbox, AGENTCTL, prop), prop
        assert AGENTCTL not in _unit_list(sdbox, BACKEND, prop), prop
    for prop in ("ConsistsOf", "BoundBy", "RequisiteOf", "RequiredBy"):
        assert AGENTCTL not in _unit_list(sdbox, BACKEND, prop), prop
        assert BACKEND not in _unit_list(sdbox, AGENTCTL, prop), prop


def test_restart_policies(sdbox: SdBox, units: list[str]) -> None:
    """The control server's state lives only in memory: systemd must never restart it (a new
    lifetime would hold nothing). The backend restarts on failure, after 1 s."""
    assert sdbox.prop(AGENTCTL, "Restart") == "no"
    assert sdbox.prop(BACKEND, "Restart") == "on-failure"
    assert sdbox.prop(BACKEND, "RestartUSec") == "1s"


def test_timeouts(sdbox: SdBox, units: list[str]) -> None:
    """The backend's start timeout exceeds the longest recovery deadline (5 min, README.md#configuration)."""
    assert sdbox.prop(BACKEND, "TimeoutStartUSec") == "6min"
    assert sdbox.prop(BACKEND, "TimeoutStopUSec") == "30s"
    assert sdbox.prop(AGENTCTL, "TimeoutStopUSec") == "15s"


def test_home_environment_and_credential(sdbox: SdBox, units: list[str]) -> None:
    """Both daemons use /var/lib/kandev as Kandev home (docs/architecture.md#the-home), systemd creates it 0750, and
    the control server receives the bootstrap credential through LoadCredential= (docs/architecture.md#ownership)."""
    for unit in (BACKEND, AGENTCTL):
        env = sdbox.prop(unit, "Environment").split()
        assert "KANDEV_HOME=/var/lib/kandev" in env and "PYTHONUNBUFFERED=1" in env
        assert sdbox.prop(unit, "StateDirectory") == "kandev"
        assert sdbox.prop(unit, "StateDirectoryMode") == "0750"
    # `systemctl show` prints LoadCredential as [unprintable]; ask the manager over D-Bus instead
    p = sdbox.run(
        "busctl", "--json=short", "get-property", "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1/unit/kandev_2dagentctl_2eservice",
        "org.freedesktop.systemd1.Service", "LoadCredential",
    )
    assert json.loads(p.stdout)["data"] == [
        ["agentctl-credential", "/var/lib/kandev/secrets/agentctl-bootstrap"]
    ]


def test_sockets_not_in_a_directory_systemd_removes(sdbox: SdBox, units: list[str]) -> None:
    """docs/architecture.md#lifetimes: the control socket must not live in the backend's RuntimeDirectory= (deleted
    when the backend stops) nor in /tmp or /var/tmp, which PrivateTmp= makes private per unit: the
    sockets live in <home>/run, and the home is the StateDirectory, outside both."""
    for unit in (BACKEND, AGENTCTL):
        assert sdbox.prop(unit, "RuntimeDirectory") == ""
        home = [e.split("=", 1)[1] for e in sdbox.prop(unit, "Environment").split() if e.startswith("KANDEV_HOME=")]
        assert home == ["/var/lib/kandev"] and not home[0].startswith(("/tmp", "/var/tmp"))


def test_install_sections(sdbox: SdBox, units: list[str]) -> None:
    """The backend is enabled into multi-user.target; the control server has no [Install] section
    ("static"): only the backend starts it, through systemd."""
    assert sdbox.prop(AGENTCTL, "UnitFileState") == "static"
    assert sdbox.prop(BACKEND, "UnitFileState") == "disabled"
    sdbox.systemctl("enable", BACKEND)
    try:
        assert BACKEND in _unit_list(sdbox, "multi-user.target", "Wants")
        assert sdbox.prop(BACKEND, "ActiveState") == "inactive"  # enable does not start it
    finally:
        sdbox.systemctl("disable", BACKEND)
    assert sdbox.prop(BACKEND, "UnitFileState") == "disabled"


def test_no_unit_file_uses_killmode_process_or_none() -> None:
    """docs/architecture.md#lifetimes: no unit ever uses KillMode=process or KillMode=none (host-side check of every
    file under units/, comments included; needs no box)."""
    files = sorted(p for p in UNITS_DIR.rglob("*") if p.is_file())
    assert files, f"no unit files under {UNITS_DIR}"
    bad = re.compile(r"KillMode\s*=\s*(process|none)\b", re.IGNORECASE)
    offenders = [f"{f}:{n}" for f in files for n, line in enumerate(f.read_text().splitlines(), 1)
                 if bad.search(line)]
    assert not offenders, offenders
