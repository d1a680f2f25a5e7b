"""`kandev doctor` (daemon/cli/doctor.py): each check's pass/fail, reason and fix hint, host probes injected."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from daemon import cli
from daemon.agentctl.sandbox.bubblewrap import SandboxSupport
from daemon.cli import doctor
from daemon.cli.doctor import DoctorProbes, run_doctor
from daemon.config.platform import Probes
from daemon.core.version import VERSION
from daemon.host.paths import Paths

HEAD = "0001"


def _no_systemctl(argv: Sequence[str]) -> str | None:
    return None


def probes(**over: Any) -> DoctorProbes:
    base = DoctorProbes(
        platform=Probes(
            platform=lambda: "linux",
            systemd_booted=lambda: False,
            systemctl=_no_systemctl,
            euid=lambda: 1000,
            polkit_rules=lambda: [],
            cgroup=lambda: "0::/user.slice/user-1000.slice/session-1.scope\n",
        ),
        systemctl_show=lambda unit, props: None,
        backend_status=lambda sock: {"backend": {"state": "ready", "pid": 42, "version": VERSION}},
        which=lambda name, path: f"/usr/bin/{name}",
        version=lambda exe: "v20.0.0",
        euid=os.geteuid,
        groups=lambda: [os.getegid()],
        service_gid=lambda: None,
        user_ids=lambda name: (999, 999),
        head_revision=lambda: HEAD,
        sandbox_probe=lambda env: SandboxSupport(True, None, "/usr/bin/bwrap", "0.8.0"),
    )
    return replace(base, **over)


def _store(path: Path, revision: str | None = HEAD) -> None:
    conn = sqlite3.connect(path)
    if revision is not None:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    else:
        conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Paths]:
    """A healthy home: 0750, run 0750 with a 0660 socket, secrets 0700, a migrated store."""
    paths = Paths.for_home(tmp_path / "home")
    paths.home.mkdir(mode=0o750)
    os.chmod(paths.home, 0o750)
    for d, mode in ((paths.run_dir, 0o750), (paths.secrets_dir, 0o700)):
        d.mkdir()
        os.chmod(d, mode)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(paths.backend_socket))
    os.chmod(paths.backend_socket, 0o660)
    _store(paths.db_path)
    yield paths
    s.close()


def by_name(checks: list[Any]) -> dict[str, Any]:
    return {c.name: c for c in checks}


def test_healthy_home_all_pass_and_json_shape(home: Paths) -> None:
    checks = run_doctor(home, env={}, probes=probes())
    failing = [c for c in checks if not c.ok]
    assert not failing, failing
    names = [c.name for c in checks]
    assert names[0] == "config"
    assert {"home", "run_dir", "secrets_dir", "backend_socket", "store", "node", "npm"} <= set(names)
    assert {"platform.platform", "platform.service_manager", "platform.capability"} <= set(names)
    out = doctor.as_json(checks)
    assert out["ok"] is True
    assert set(out["checks"][0]) == {"name", "ok", "detail", "hint"}
    assert all(c["hint"] is None for c in out["checks"])  # a passing check carries no hint
    c = by_name(checks)
    assert "backend ready, pid 42" in c["backend_socket"].detail
    assert "revision 0001 (head)" in c["store"].detail
    assert json.loads(json.dumps(out)) == out


def test_every_failure_has_a_reason_and_a_hint(home: Paths) -> None:
    os.chmod(home.secrets_dir, 0o755)
    os.chmod(home.home, 0o755)
    checks = by_name(run_doctor(home, env={}, probes=probes(which=lambda name, path: None)))
    for name in ("secrets_dir", "home", "node", "npm"):
        assert not checks[name].ok and checks[name].detail and checks[name].hint, name
    assert "0755" in checks["secrets_dir"].detail and "chmod 0700" in checks["secrets_dir"].hint
    assert "chmod 0750" in checks["home"].hint
    assert "nodejs" in checks["node"].hint and "not found" in checks["node"].detail


def test_no_backend_running(home: Paths) -> None:
    home.backend_socket.unlink()
    c = by_name(run_doctor(home, env={}, probes=probes()))["backend_socket"]
    assert not c.ok and "not running" in c.detail and "systemctl start kandev-backend" in c.hint


def test_stale_socket_nobody_answers(home: Paths) -> None:
    c = by_name(run_doctor(home, env={}, probes=probes(backend_status=lambda sock: None)))["backend_socket"]
    assert not c.ok and "nobody answers" in c.detail and "journalctl" in c.hint


def test_socket_of_another_user_points_at_the_kandev_group(home: Paths) -> None:
    p = probes(euid=lambda: 4242, groups=lambda: [4242], service_gid=lambda: 998)
    c = by_name(run_doctor(home, env={}, probes=p))["backend_socket"]
    assert not c.ok and "may not connect" in c.detail and "adduser $USER kandev" in c.hint


def test_loose_socket_mode_fails(home: Paths) -> None:
    os.chmod(home.backend_socket, 0o666)
    c = by_name(run_doctor(home, env={}, probes=probes()))["backend_socket"]
    assert not c.ok and "0666" in c.detail


def test_agentctl_sockets_must_be_owner_only(home: Paths) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = home.run_dir / "agentctl-0123abcd.sock"
    s.bind(str(path))
    try:
        os.chmod(path, 0o600)
        assert by_name(run_doctor(home, env={}, probes=probes()))["agentctl_sockets"].ok
        os.chmod(path, 0o660)
        c = by_name(run_doctor(home, env={}, probes=probes()))["agentctl_sockets"]
        assert not c.ok and "0660" in c.detail
    finally:
        s.close()


def test_missing_home(tmp_path: Path) -> None:
    checks = by_name(run_doctor(Paths.for_home(tmp_path / "nope"), env={}, probes=probes()))
    assert not checks["home"].ok and "does not exist" in checks["home"].detail
    assert not checks["store"].ok and "creates and migrates" in checks["store"].hint


def test_store_states(home: Paths) -> None:
    home.db_path.unlink()
    _store(home.db_path, "0000")
    c = by_name(run_doctor(home, env={}, probes=probes()))["store"]
    assert c.ok and "head is 0001" in c.detail and "next start" in c.detail
    home.db_path.unlink()
    _store(home.db_path, None)
    c = by_name(run_doctor(home, env={}, probes=probes()))["store"]
    assert not c.ok and "no alembic revision" in c.detail and c.hint
    home.db_path.write_bytes(b"not a database, just some bytes" * 100)
    c = by_name(run_doctor(home, env={}, probes=probes()))["store"]
    assert not c.ok and "cannot open read-only" in c.detail and "damaged" in c.hint


def test_invalid_config_is_a_failing_check(home: Paths) -> None:
    env = {"KANDEV_AGENTCTL_RECOVERY_READ_RETRIES": "99"}
    c = by_name(run_doctor(home, env=env, probes=probes()))["config"]
    assert not c.ok and "recovery_read_retries" in c.detail and "kandev.toml" in c.hint


def _systemd(backend: dict[str, str], agentctl: dict[str, str], **over: Any) -> DoctorProbes:
    states = {"kandev-backend.service": backend, "kandev-agentctl.service": agentctl}
    base = probes()
    plat = replace(base.platform, systemd_booted=lambda: True,
                   systemctl=lambda argv: "loaded" if "LoadState" in argv else None)
    return replace(base, platform=plat, systemctl_show=lambda unit, props: states[unit], **over)


ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "UnitFileState": "enabled",
          "Result": "success", "MainPID": "77", "User": "kandev"}
STATIC = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "UnitFileState": "static",
          "Result": "success", "MainPID": "0", "User": "kandev"}


def test_under_systemd_platform_is_evaluated_as_the_backend_unit(home: Paths) -> None:
    """The platform conditions as kandev-backend.service meets them: its cgroup, its user (not root,
    so the polkit rule decides), the service PATH for node/npm."""
    seen_paths: list[str | None] = []

    def which(name: str, path: str | None) -> str | None:
        seen_paths.append(path)
        return f"/usr/bin/{name}"

    checks = by_name(run_doctor(home, env={"PATH": "/home/me/bin"}, probes=_systemd(ACTIVE, STATIC, which=which)))
    assert checks["unit.kandev-backend.service"].ok and "main pid 77" in checks["unit.kandev-backend.service"].detail
    assert checks["unit.kandev-agentctl.service"].ok
    assert "kandev-backend.service" in checks["platform.service_manager"].detail
    assert not checks["platform.unit_control"].ok  # uid of kandev, no polkit rule
    assert "polkit" in checks["platform.unit_control"].hint
    assert seen_paths == [doctor.SERVICE_PATH] * 2
    # with the rule, it passes
    ok = _systemd(ACTIVE, STATIC)
    ok = replace(ok, platform=replace(ok.platform, polkit_rules=lambda: ["/usr/share/polkit-1/rules.d/50-kandev.rules"]))
    assert by_name(run_doctor(home, env={}, probes=ok))["platform.unit_control"].ok


def test_failed_units_point_at_the_journal(home: Paths) -> None:
    failed = {**ACTIVE, "ActiveState": "failed", "SubState": "failed", "Result": "watchdog"}
    failed_ctl = {**STATIC, "ActiveState": "failed", "Result": "exit-code"}
    checks = by_name(run_doctor(home, env={}, probes=_systemd(failed, failed_ctl)))
    b, a = checks["unit.kandev-backend.service"], checks["unit.kandev-agentctl.service"]
    assert not b.ok and "watchdog" in b.detail and "journalctl -u kandev-backend.service" in b.hint
    assert not a.ok and "reset-failed" in a.hint


def test_inactive_backend_unit_hint_enables_it(home: Paths) -> None:
    inactive = {**ACTIVE, "ActiveState": "inactive", "SubState": "dead", "UnitFileState": "disabled"}
    c = by_name(run_doctor(home, env={}, probes=_systemd(inactive, STATIC)))["unit.kandev-backend.service"]
    assert not c.ok and c.hint == "systemctl enable --now kandev-backend.service"


def test_text_output_lists_every_check_with_hints() -> None:
    from daemon.config.platform import Check

    text = doctor.as_text([Check("a", True, "fine"), Check("bb", False, "broken", "do this")])
    lines = text.splitlines()
    assert lines[0].startswith("PASS  a ") and lines[1].startswith("FAIL  bb")
    assert "fix: do this" in lines[2] and lines[-1] == "doctor: 2 checks, 1 failing"


def test_cli_doctor_exit_code_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kandev --json doctor` prints {ok, checks:[{name, ok, detail, hint}]}; exit 1 when one fails
    (the home does not exist here)."""
    rc = cli.main(["--home", str(tmp_path / "none"), "--json", "doctor"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["ok"] is False
    assert {c["name"] for c in out["checks"]} >= {"config", "home", "store", "node", "npm"}
    assert all(set(c) == {"name", "ok", "detail", "hint"} for c in out["checks"])


def test_cli_agents_lists_builtin_agents(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "agents"]) == 0
    agents = json.loads(capsys.readouterr().out)["agents"]
    mock = next(a for a in agents if a["name"] == "mock")
    assert {"package": "daemon.agents.mock", "version": VERSION, "env": [], "secret_env": {}}.items() <= mock.items()
    assert cli.main(["agents"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Configuration: ")
    header = out.index(next(line for line in out if line.startswith("AGENT ")))
    assert out[header].split() == ["AGENT", "PACKAGE", "VERSION", "SECRET_ENV", "HOME_FILES", "ENV", "NETWORK"]
    rows = [line.split() for line in out[header + 1:] if line.strip()]
    assert [row[:3] for row in rows] == [[a["name"], a["package"], a["version"]] for a in agents]  # same order
    assert ["mock", "daemon.agents.mock", VERSION, "-", "-", "-", "allow-list"] in rows


def _with_server(**server: Any) -> Any:
    status = {"backend": {"state": "ready", "pid": 42, "version": VERSION},
              "control_server": {"pid": 7, "crash_loop": {"limit": 5, "window_s": 300.0}, "restarts": 0,
                                 "passthrough": {"state": "none"}, **server}}
    return lambda sock: status


def test_control_server_states_from_the_backend(home: Paths) -> None:
    """Issue 11: doctor says when the backend gave up restarting its control server, and why."""
    loss = {"at": "2025-01-31T12:00:00Z", "reason": "restart failed: exited with code -9", "at_start": True}
    running = by_name(run_doctor(home, env={}, probes=probes(backend_status=_with_server(state="running"))))
    assert running["control_server"].ok and "pid 7" in running["control_server"].detail
    assert "control_server.passthrough" not in running  # never started: nothing to say
    gave_up = by_name(run_doctor(home, env={}, probes=probes(
        backend_status=_with_server(state="gave_up", pid=None, gave_up=loss, last_loss=loss))))["control_server"]
    assert not gave_up.ok
    assert "gave up restarting it after 5 losses within 300.0 s" in gave_up.detail
    assert "exited with code -9" in gave_up.detail and "kandev up" in gave_up.hint
    restarting = by_name(run_doctor(home, env={}, probes=probes(
        backend_status=_with_server(state="restarting", pid=None, last_loss=loss))))["control_server"]
    assert not restarting.ok and "restarting" in restarting.detail


def test_control_server_check_says_whether_it_runs_the_installed_version(home: Paths) -> None:
    """Issue 15: an outdated server that can reload is a failed check with the command that fixes it;
    one that cannot waits for its replacement (fine); a reload in progress is fine."""
    current = by_name(run_doctor(home, env={}, probes=probes(backend_status=_with_server(
        state="running", version="0.2.0", installed_version="0.2.0", can_reload=True))))["control_server"]
    assert current.ok and "version 0.2.0" in current.detail
    outdated = by_name(run_doctor(home, env={}, probes=probes(backend_status=_with_server(
        state="running", version="0.2.0", installed_version="0.2.1", can_reload=True))))["control_server"]
    assert not outdated.ok and "0.2.1 is installed" in outdated.detail and "kandev agentctl reload" in outdated.hint
    old = by_name(run_doctor(home, env={}, probes=probes(backend_status=_with_server(
        state="running", version=None, installed_version="0.2.0", can_reload=False,
        replacement="when_idle"))))["control_server"]
    assert old.ok and "replaces it once it runs no instance" in old.detail
    reloading = by_name(run_doctor(home, env={}, probes=probes(backend_status=_with_server(
        state="reloading", version="0.2.0", installed_version="0.2.0", can_reload=True))))["control_server"]
    assert reloading.ok and reloading.detail.startswith("reloading")


def _status_with_sandbox(**sandbox: Any) -> Any:
    return lambda sock: {"backend": {"state": "ready", "pid": 42, "version": VERSION}, "sandbox": sandbox}


def test_sandbox_check_says_whether_agents_are_sandboxed_and_why_not(home: Paths, tmp_path: Path) -> None:
    """Issue 10 scenario B: doctor says why agents cannot be sandboxed, from what the running control
    server reports through the backend, else from its own probe (which gets the backend's PATH)."""
    ok = by_name(run_doctor(home, env={}, probes=probes(backend_status=_status_with_sandbox(
        policy="required", available=True, sandboxed=True, version="0.8.0", reason=None,
        seccomp="kandev-seccomp/1 sha256:0123456789ab"))))["sandbox"]
    # Issue 44 item 6: and under which system-call filter
    assert ok.ok and "sandboxed (bubblewrap 0.8.0, system-call filter kandev-seccomp/1 sha256:0123456789ab)" in ok.detail

    reason = "bwrap (bubblewrap) is not on the PATH (/nowhere)"
    bad = by_name(run_doctor(home, env={}, probes=probes(backend_status=_status_with_sandbox(
        policy="required", available=False, sandboxed=False, reason=reason))))["sandbox"]
    assert not bad.ok and reason in bad.detail and "apt-get install bubblewrap" in bad.hint

    seen: list[Any] = []

    def failing_probe(env: Any) -> SandboxSupport:
        seen.append(env["PATH"])
        return SandboxSupport(False, "bwrap cannot make a sandbox here: bwrap: No permissions to create new namespace")

    local = by_name(run_doctor(home, env={"PATH": "/usr/bin"}, probes=probes(backend_status=lambda sock: None,
                                                                            sandbox_probe=failing_probe)))["sandbox"]
    assert not local.ok and "No permissions to create new namespace" in local.detail
    assert "sandbox_unavailable" in local.detail and "probed by this command" in local.detail
    assert seen == ["/usr/bin"]

    conf = tmp_path / "off.toml"
    conf.write_text('[agents]\nsandbox = "off"\n')
    off = by_name(run_doctor(home, config_path=str(conf), env={}, probes=probes(sandbox_probe=failing_probe)))
    assert off["sandbox"].ok and "WITHOUT a sandbox" in off["sandbox"].detail
