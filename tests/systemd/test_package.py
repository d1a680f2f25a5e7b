"""The Debian package end to end (Issue 6 scenario A, Issue 6 scenario B, Issue 6 scenario C, Issue 6 scenario D and Issue 6 scenario E), inside a sdbox.

Issue 10 scenario A in the installed package: a GitHub-backed session's agent, re-tracked after the
backend's SIGKILL, is attacked from inside (``/sh``) and reaches nothing of kandev (the token file
under /etc/kandev included), while its own work and ``/git-credential`` succeed; the bootstrap
credential is gone once the control server consumed it, and the home stays private.

Hostile workspaces in the installed package (each test cites its Issue 19 scenario), where agents
keep the service uid ``kandev`` (docs/architecture.md, "Which uid an agent is"): the attacks of
tests/integration/test_hostile_workspaces.py (shared machinery in
``tests/support/hostile_workspaces.py``) on repositories and canaries of the kandev user, from inside
with the mock's ``/sh``; the automatic resume follows ``systemctl kill`` of the control server's unit.

The .deb is built once per content of what goes into it, with a rebuild of a higher version (the
upgrade) and the lintian report (``tests/support/debs.py``, cached in /var/tmp/kandev-deb-cache/).

Inside the box (no network: apt resolves the Depends from what set-up installed on the host) the
tests run in file order on one box, each step starting from the state the previous one left:
install -> survival on -> the demo flow as root and as a kandev group member, SIGKILL ->
restart -> upgrade -> journal -> exposure score -> hostile workspaces -> claude-code with a credential ->
remove -> reinstall -> purge.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.debs import build_packages
from tests.support.hostile_workspaces import (
    GIT,
    agent_said,
    canary_script,
    contained_attempts,
    parse_tree,
    plant_commondir,
    plant_gitdir,
    plant_repository,
    repository_attempts,
    repository_script,
    tree_argv,
)
from tests.support.sandbox_attacks import attack_script, attack_verdicts, connect_argv
from tests.support.sdbox import SdBox

BACKEND, AGENTCTL = "kandev-backend.service", "kandev-agentctl.service"
HOME = "/var/lib/kandev"
EXPOSURE_LIMIT = 2.5
TOKEN_FILE = "/etc/kandev/github-token"
UPSTREAM = "ghp_PACKAGEupstreamToken0123456789abcdef"
GH_REPO = f"{HOME}/repos/repo"
REPO = Path(__file__).resolve().parents[2]
METRICS = Path("/var/tmp/kandev-package-metrics.json")  # figures for humans (build time, scores)
# 300 s bounds each test's own steps. The module's fixtures are bounded by their own limits: the
# cached build (two dpkg-buildpackage runs and lintian, each under its subprocess timeout in
# tests/support/debs.py; 200-300 s cold on a loaded 2-core machine, plus the wait under the shared
# build lock for another worker's build) and the box's boot (60 s). Counted against the first test,
# a cold build timed it out, and with it every test of the module (a fixture's error is cached).
pytestmark = pytest.mark.timeout(300, func_only=True)


def _record(**figures: Any) -> None:
    try:
        data = json.loads(METRICS.read_text())
    except (OSError, ValueError):
        data = {}
    data.update(figures)
    METRICS.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.fixture(scope="module")
def debs() -> dict[str, Any]:
    meta = build_packages()
    _record(build_seconds=meta["build_seconds"], rebuild_seconds=meta["rebuild_seconds"],
            deb_bytes=meta["deb"].stat().st_size)
    return meta


# ---------------------------------------------------------------- inside the box

S: dict[str, Any] = {}  # state handed from one step to the next


class Box:
    def __init__(self, box: SdBox, debs: dict[str, Any]) -> None:
        self.box, self.debs = box, debs

    def apt(self, *args: str, timeout: float = 240) -> str:
        p = self.box.run("env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q", "--no-install-recommends",
                         "-o", "Dpkg::Options::=--force-confold", *args, check=False, timeout=timeout)
        assert p.returncode == 0, f"apt-get {args}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p.stdout

    def install(self, deb: Path) -> float:
        shutil.copy2(deb, self.box.share / deb.name)
        t0 = time.monotonic()
        self.apt("install", f"/sdbox/{deb.name}")
        return time.monotonic() - t0

    def kandev(self, *args: str, user: str | None = None, check: bool = True) -> dict[str, Any]:
        argv = ["kandev", "--json", *args]
        if user:
            argv = ["runuser", "-u", user, "--", *argv]
        p = self.box.run(*argv, check=False, timeout=120)
        if check:
            assert p.returncode == 0, f"{argv}: rc={p.returncode} {p.stderr} {p.stdout}"
        out = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
        out["_rc"], out["_stderr"] = p.returncode, p.stderr
        return out

    def prop(self, unit: str, name: str) -> str:
        return self.box.prop(unit, name)

    def systemctl_as_kandev(self, *args: str) -> Any:
        return self.box.run("setpriv", "--reuid=kandev", "--regid=kandev", "--init-groups",
                            "systemctl", "--no-ask-password", *args, check=False)

    def show(self, sid: str, user: str | None = None) -> dict[str, Any]:
        return self.kandev("session", "show", sid, user=user)


@pytest.fixture(scope="module")
def pkg(sdbox: SdBox, debs: dict[str, Any]) -> Box:
    # A container image's /usr/sbin/policy-rc.d (exit 101) forbids maintainer scripts to start,
    # restart or stop services; the box stands for a real machine, which has none (the box's writes,
    # this removal included, vanish with it).
    sdbox.run("rm", "-f", "/usr/sbin/policy-rc.d")
    # No man-db trigger: without this file dpkg's trigger skips rebuilding the manual page index
    # (man-db's own switch; ~4 s of CPU per install, nothing the tests read).
    sdbox.run("rm", "-f", "/var/lib/man-db/auto-update")
    return Box(sdbox, debs)


def chunks(show: dict[str, Any]) -> list[str]:
    return [m["text"] for m in show["transcript"] if m["kind"] == "agent_message_chunk"]


def in_order(texts: list[str], n: int) -> bool:
    return texts == [f"{i}/{n} " for i in range(1, len(texts) + 1)]


def retracked_same_agent(b: Box, sid: str, user: str | None = None, timeout: float = 60) -> dict[str, Any]:
    show = b.box.wait_for(lambda: s if (s := b.show(sid, user))["retracked"] else None, timeout=timeout)
    assert show, f"session {sid} was not re-tracked"
    assert show["state"] == "RUNNING"
    assert (show["agent_pid"], show["agent_pid_start_time"]) == (S["agent_pid"], S["agent_start"])
    assert b.box.alive(S["agent_pid"])
    return show


# ---------------------------------------------------------------- the steps, in order


def test_lintian_clean(debs: dict[str, Any]) -> None:
    """0 errors, 0 warnings (info and pedantic tags are either overridden with a reason in
    debian/kandev.lintian-overrides or printed here for a human)."""
    report = debs["lintian"]
    bad = [line for line in report.splitlines() if line.startswith(("E:", "W:"))]
    assert not bad and debs["lintian_rc"] == 0, report


def test_a_install(pkg: Box) -> None:
    """apt-get install ./kandev_*.deb: user, home, files in their places, the backend enabled and
    started, the control server installed but neither enabled nor started."""
    b = pkg
    seconds = b.install(b.debs["deb"])
    _record(install_seconds=round(seconds, 1))
    assert b.box.run("dpkg-query", "-W", "-f", "${Status} ${Version}", "kandev").stdout == (
        f"install ok installed {b.debs['version']}")
    passwd = b.box.run("getent", "passwd", "kandev").stdout.strip().split(":")
    assert passwd[5] == HOME and passwd[6] in ("/usr/sbin/nologin", "/sbin/nologin")
    assert b.box.run("stat", "-c", "%U:%G %a", HOME).stdout.strip() == "kandev:kandev 750"
    for path in ("/usr/lib/systemd/system/kandev-backend.service", "/usr/lib/systemd/system/kandev-agentctl.service",
                 "/usr/lib/sysusers.d/kandev.conf", "/usr/lib/tmpfiles.d/kandev.conf",
                 "/usr/share/polkit-1/rules.d/50-kandev.rules", "/usr/share/bash-completion/completions/kandev",
                 "/usr/lib/kandev/daemon/cli/__init__.py", "/usr/lib/kandev/vendor/sqlalchemy/__init__.py",
                 "/usr/share/doc/kandev/vendored.txt"):
        b.box.run("test", "-e", path)
    # private modules: nothing in dist-packages, and Debian's python3 alone does not see them
    b.box.run("test", "!", "-e", "/usr/lib/python3/dist-packages/daemon")
    assert b.box.run("python3", "-c", "import daemon", check=False).returncode != 0
    assert "/etc/kandev/kandev.toml" in b.box.run("cat", "/var/lib/dpkg/info/kandev.conffiles").stdout
    # merged /usr: systemd 252 finds it through /lib/systemd/system, the same directory
    assert b.prop(BACKEND, "FragmentPath") in (f"/usr/lib/systemd/system/{BACKEND}", f"/lib/systemd/system/{BACKEND}")
    assert b.prop(BACKEND, "UnitFileState") == "enabled" and b.prop(BACKEND, "ActiveState") == "active"
    assert b.prop(AGENTCTL, "UnitFileState") == "static" and b.prop(AGENTCTL, "ActiveState") == "inactive"
    b.box.systemctl("start", BACKEND)  # what an operator types: already running, a no-op
    st = b.kandev("status")
    assert st["capability"]["state"] == "disabled" and st["backend"]["state"] == "ready"  # survival off by default
    agents = b.kandev("agents")["agents"]
    assert any(a["name"] == "mock" for a in agents)


def test_a_doctor_on_the_installed_package(pkg: Box) -> None:
    d = pkg.kandev("doctor", check=False)
    checks = {c["name"]: c for c in d["checks"]}
    must = ["config", "unit.kandev-backend.service", "unit.kandev-agentctl.service", "platform.agentctl_unit",
            "platform.unit_control", "platform.capability", "home", "run_dir", "secrets_dir", "backend_socket",
            "store"]
    failing = {n: checks[n] for n in must if not checks[n]["ok"]}
    assert not failing, failing
    assert "kandev-backend.service" in checks["platform.service_manager"]["detail"]
    assert d["_rc"] == (0 if d["ok"] else 1)


def test_a_polkit_lets_kandev_control_only_the_control_server(pkg: Box) -> None:
    """The packaged rule, as the real polkitd evaluates it: the kandev user may start/stop/restart
    kandev-agentctl.service, and nothing else (another unit, another verb)."""
    b = pkg
    b.box.write_file("/etc/systemd/system/kandev-dummy.service",
                     "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\n")
    b.box.systemctl("daemon-reload")

    as_kandev = b.systemctl_as_kandev
    assert as_kandev("stop", AGENTCTL).returncode == 0  # allowed (and a no-op: it is not running)
    assert as_kandev("restart", AGENTCTL).returncode != 0  # allowed, but no bootstrap credential: 243
    assert b.prop(AGENTCTL, "Result") == "exit-code" or "credential" in b.prop(AGENTCTL, "StatusText").lower() or \
        b.prop(AGENTCTL, "ExecMainStatus") == "243"
    b.box.systemctl("reset-failed", AGENTCTL)
    for args in (("start", "kandev-dummy.service"), ("stop", BACKEND), ("restart", BACKEND),
                 ("reload", AGENTCTL), ("disable", BACKEND)):
        p = as_kandev(*args)
        assert p.returncode != 0 and ("Access denied" in p.stderr or "authentication" in p.stderr.lower()), (args, p)
    assert b.prop("kandev-dummy.service", "ActiveState") == "inactive"
    assert b.prop(BACKEND, "ActiveState") == "active"


def test_b_survival_on_demo_flow_as_root_and_group_member(pkg: Box) -> None:
    """Survival switched on in /etc/kandev/kandev.toml; the CLI as a member of the kandev group
    runs the demo (task, session, /slow turn); root SIGKILLs the backend; the same agent is
    re-tracked. A user outside the group is refused."""
    b = pkg
    conf = b.box.read_file("/etc/kandev/kandev.toml")
    assert "#agent_survival = false" in conf and '#github_token_file = ""' in conf
    b.box.write_file(TOKEN_FILE, UPSTREAM + "\n", mode=0o600)
    b.box.run("chown", "kandev:kandev", TOKEN_FILE)
    b.box.write_file("/etc/kandev/kandev.toml", conf.replace("#agent_survival = false", "agent_survival = true")
                     .replace('#github_token_file = ""', f'github_token_file = "{TOKEN_FILE}"'))
    b.box.systemctl("restart", BACKEND)
    st = b.kandev("status")
    assert st["capability"]["state"] == "enabled", st["capability"]
    assert st["control_server"]["mode"] == "unit"
    assert b.prop(AGENTCTL, "ActiveState") == "active"  # started by the backend, as kandev, through polkit
    assert b.prop(AGENTCTL, "User") == "kandev"
    S["ctl_pid"] = b.prop(AGENTCTL, "MainPID")
    p = b.systemctl_as_kandev("kill", AGENTCTL)  # a verb the polkit rule does not grant
    assert p.returncode != 0 and ("Access denied" in p.stderr or "authentication required" in p.stderr), p
    assert b.box.run("stat", "-c", "%a %G", f"{HOME}/run").stdout.strip() == "750 kandev"
    assert b.box.run("stat", "-c", "%a %G", f"{HOME}/run/backend.sock").stdout.strip() == "660 kandev"
    ctl_socks = b.box.run("sh", "-c", f"stat -c %a {HOME}/run/agentctl-*.sock").stdout.split()
    assert ctl_socks and set(ctl_socks) == {"600"}

    b.box.run("useradd", "--create-home", "--groups", "kandev", "alice")
    b.box.run("useradd", "--create-home", "bob")
    refused = b.kandev("status", user="bob", check=False)
    assert refused["_rc"] == 3 and "Permission denied" in refused["_stderr"], refused

    # a group member's doctor reaches the backend; the store and secrets stay private to kandev
    d = {c["name"]: c for c in b.kandev("doctor", user="alice", check=False)["checks"]}
    assert d["backend_socket"]["ok"] and d["run_dir"]["ok"] and d["secrets_dir"]["ok"], d
    assert not d["store"]["ok"] and "sudo kandev doctor" in d["store"]["hint"]

    task = b.kandev("task", "create", "--title", "packaged survival", user="alice")["task_id"]
    sid = b.kandev("session", "start", task, user="alice")["session_id"]
    # Issue 10: a GitHub-backed workspace of the kandev user (under the home, the units' writable place)
    for argv in (["mkdir", "-p", GH_REPO], ["git", "init", "-q", GH_REPO],
                 ["git", "-C", GH_REPO, "remote", "add", "origin", "https://github.com/example/repo.git"]):
        b.box.run("runuser", "-u", "kandev", "--", *argv)
    gh_task = b.kandev("task", "create", "--title", "guest", "--workspace", GH_REPO)["task_id"]
    S["gh_sid"] = b.kandev("session", "start", gh_task)["session_id"]
    S["gh_agent"] = b.show(S["gh_sid"])["agent_pid"]
    # consumed by the control server's unit when it started: removed (Issue 10 item 9)
    assert b.box.run("test", "-e", f"{HOME}/secrets/agentctl-bootstrap", check=False).returncode != 0
    b.kandev("prompt", sid, "/slow 300", user="alice")
    show = b.box.wait_for(lambda: s if len(chunks(s := b.show(sid, "alice"))) >= 2 else None, timeout=30)
    assert show and show["state"] == "RUNNING"
    S.update(task=task, sid=sid, agent_pid=show["agent_pid"], agent_start=show["agent_pid_start_time"],
             instance=show["instance_id"])

    old = b.prop(BACKEND, "MainPID")
    b.box.systemctl("kill", "-s", "KILL", BACKEND)  # as root
    assert b.box.wait_for(lambda: b.prop(BACKEND, "MainPID") not in ("0", old)
                          and b.prop(BACKEND, "ActiveState") == "active", timeout=60), "backend not restarted"
    show = retracked_same_agent(b, sid, "alice")
    assert b.prop(AGENTCTL, "MainPID") == S["ctl_pid"]
    assert in_order(chunks(show), 300)
    gh = b.box.wait_for(lambda: s if (s := b.show(S["gh_sid"]))["retracked"] else None, timeout=60)
    assert gh and gh["agent_pid"] == S["gh_agent"]
    _attack_from_inside(b)


def _says(b: Box, sid: str, prompt: str) -> str:
    b.kandev("prompt", sid, prompt, "--wait")
    return chunks(b.show(sid))[-1]


def _attack_from_inside(b: Box) -> None:
    """Issue 10 scenario A in the installed package (the agent of S["gh_sid"], re-tracked)."""
    st = b.kandev("status")
    assert st["sandbox"]["sandboxed"] is True, st["sandbox"]
    secrets = b.box.run("ls", f"{HOME}/secrets").stdout.split()
    denied = {
        "token_file": ["cat", TOKEN_FILE],
        "store": ["cat", f"{HOME}/kandev.db"],
        "secrets_dir": ["ls", f"{HOME}/secrets"],
        **{f"secret_{i}": ["cat", f"{HOME}/secrets/{n}"] for i, n in enumerate(secrets)},
        "run_dir": ["ls", f"{HOME}/run"],
        "logs_dir": ["ls", f"{HOME}/logs"],
        "other_workspace": ["ls", f"{HOME}/worktrees/{S['task']}"],
        "other_session": ["ls", f"{HOME}/sessions/{S['sid']}"],
        "backend_environ": ["cat", f"/proc/{st['backend']['pid']}/environ"],
        "backend_socket": connect_argv(st["backend"]["socket"]),
        "agentctl_socket": connect_argv(st["control_server"]["endpoint"]),
        "kill_backend": ["kill", "-0", str(st["backend"]["pid"])],
        "kill_agentctl": ["kill", "-0", str(st["control_server"]["pid"])],
        "kill_other_agent": ["kill", "-0", str(S["agent_pid"])],
        "config": ["cat", "/etc/kandev/kandev.toml"],
    }
    allowed = {
        "write_workspace": ["sh", "-c", "echo hi > probe.txt && test \"$(cat probe.txt)\" = hi"],
        "git": ["git", "status", "--porcelain"],
        "python3": ["python3", "-c", "print(6 * 7)"],
        "kandev_code": ["test", "-r", "/usr/lib/kandev/daemon/agents/mock/agent.py"],
    }
    said = _says(b, S["gh_sid"], "/sh " + attack_script(denied, allowed))
    assert said.startswith("sh: exit=0\n") and not attack_verdicts(said, denied, allowed), said
    # The session's lease checks at its endpoint; no credential is handed out (Issue 20).
    said = _says(b, S["gh_sid"], "/git-credential")
    assert said.startswith("git-credential: ok repository=github.com/") and UPSTREAM not in said, said
    # workspaces' content is the agents' work (their top directories are what keeps others out)
    loose = b.box.run("find", HOME, "-mindepth", "1", "(", "-path", f"{HOME}/worktrees/*/*", "-o", "-path",
                      f"{HOME}/repos/*", ")", "-prune", "-o", "-perm", "/077", "-print").stdout.split()
    assert sorted(loose) == [f"{HOME}/run", f"{HOME}/run/backend.sock"], loose


def test_b_restart_keeps_the_agent(pkg: Box) -> None:
    b = pkg
    b.box.systemctl("restart", BACKEND)
    show = retracked_same_agent(b, S["sid"])
    assert b.prop(AGENTCTL, "MainPID") == S["ctl_pid"]
    assert b.kandev("status")["adoption"]["outcome"] == "adopted"
    assert in_order(chunks(show), 300)


def test_b_upgrade_restarts_the_backend_never_the_control_server(pkg: Box) -> None:
    """apt-get install of the rebuilt package with a higher version: the maintainer scripts reload
    the control server (it re-executes the new code in place: same process, same agent; Issue 15 item 4), then restart the backend; the agent is re-tracked, and the transcript goes on without
    loss, duplicate or reordering."""
    b = pkg
    backend_pid = b.prop(BACKEND, "MainPID")
    ctl_started = b.prop(AGENTCTL, "ExecMainStartTimestampMonotonic")
    before = len(chunks(b.show(S["sid"])))
    seconds = b.install(b.debs["upgrade_deb"])
    _record(upgrade_seconds=round(seconds, 1))
    assert b.box.run("dpkg-query", "-W", "-f", "${Version}", "kandev").stdout == b.debs["upgrade_version"]
    assert b.prop(BACKEND, "MainPID") not in ("0", backend_pid)
    assert b.prop(AGENTCTL, "MainPID") == S["ctl_pid"]
    assert b.prop(AGENTCTL, "ExecMainStartTimestampMonotonic") == ctl_started
    ctl = b.kandev("status")["control_server"]
    assert ctl["version"] == ctl["installed_version"] == b.debs["upgrade_version"], ctl  # the new code runs
    assert ctl["reexec_count"] == 1 and ctl["last_reexec_at"] and int(ctl["pid"]) == int(S["ctl_pid"])
    show = retracked_same_agent(b, S["sid"])
    show = b.box.wait_for(lambda: s if len(chunks(s := b.show(S["sid"]))) > before + 1 else None, timeout=30)
    assert show and in_order(chunks(show), 300)
    # the config the operator edited is kept over the upgrade
    assert "\nagent_survival = true" in b.box.read_file("/etc/kandev/kandev.toml")


def test_c_journal_finds_adoptions_and_retracked_sessions(pkg: Box) -> None:
    b = pkg
    adoptions = b.box.journal_json("-u", BACKEND, "KANDEV_EVENT=adoption")
    adopted = [a for a in adoptions if a.get("OUTCOME") == "adopted"]
    assert len(adopted) >= 3, adoptions  # SIGKILL, restart, upgrade
    retracked = b.box.journal_json("-u", BACKEND, "KANDEV_EVENT=session_retracked", f"SESSION_ID={S['sid']}")
    assert len(retracked) >= 3
    assert {r["AGENT_PID"] for r in retracked} == {str(S["agent_pid"])}
    assert {r["INSTANCE_ID"] for r in retracked} == {S["instance"]}


def test_d_exposure(pkg: Box) -> None:
    scores = {}
    for unit in (BACKEND, AGENTCTL):
        out = pkg.box.run("systemd-analyze", "security", "--no-pager", unit).stdout
        m = re.search(rf"Overall exposure level for {re.escape(unit)}: ([0-9.]+)", out)
        assert m, out
        scores[unit] = float(m.group(1))
    _record(exposure=scores)
    assert scores[BACKEND] <= EXPOSURE_LIMIT, scores


# ---------------------------------------------------------------- Issue 19 under the units

HOSTILE = f"{HOME}/hostile"  # the scenarios' repositories and canaries: the kandev user's, as its agents are


def _as_kandev(b: Box, script: str) -> str:
    return b.box.run("runuser", "-u", "kandev", "--", "sh", "-c", script).stdout


def _sh(b: Box, sid: str, script: str) -> str:
    b.kandev("prompt", sid, "/sh " + script, "--wait")
    said = agent_said(b.show(sid))
    assert said.startswith("sh: "), said
    return said


def _tree(b: Box, root: str) -> dict[str, Any]:
    return parse_tree(b.box.run(*tree_argv(root)).stdout)


def _git_in_box(b: Box, repo: str, *args: str) -> str:
    return b.box.run(*GIT, "-C", repo, *args).stdout


def _hostile_repository(b: Box, name: str) -> str:
    """A repository of the kandev user (whose uid the agents keep under the units) for a scenario."""
    repo = f"{HOSTILE}/{name}"
    _as_kandev(b, f"mkdir -p {HOSTILE} && " + repository_script(repo))
    return repo


def _worktree_session(b: Box, repo: str, title: str) -> tuple[str, str]:
    task = b.kandev("task", "create", "--title", title, "--executor", "worktree", "--workspace", repo)["task_id"]
    sid = b.kandev("session", "start", task)["session_id"]
    assert b.box.wait_for(lambda: b.show(sid)["state"] == "WAITING_FOR_INPUT", timeout=60), sid
    return task, sid


def test_issue19_a_a_planted_gitdir_never_decides_what_task_delete_removes(pkg: Box) -> None:
    """Issue 19 scenario A under the units (agents keep the service uid ``kandev``, so whatever
    kandev's own processes could delete, theirs could too but for the sandbox): the agent's ``.git``
    names a fake git directory whose ``worktrees`` is a symlink to canary files of the kandev user,
    its admin directory's ``commondir`` one whose ``worktrees`` is the home; ``task delete --stop``
    leaves every canary and the home whole and removes exactly the recorded worktree."""
    b = pkg
    repo = _hostile_repository(b, "a-repo")
    canary = f"{HOSTILE}/a-canary"
    _as_kandev(b, canary_script(canary))
    before = _tree(b, canary)
    bystander = b.kandev("session", "start", b.kandev("task", "create", "--title", "a bystander")["task_id"])
    task, sid = _worktree_session(b, repo, "a attacker")
    home_before = sorted(b.box.run("ls", "-A", HOME).stdout.split())
    ws, admin = f"{HOME}/worktrees/{task}", f"{repo}/.git/worktrees/{task}"
    assert b.box.read_file(f"{ws}/.git").strip() == f"gitdir: {admin}"

    said = _sh(b, sid, plant_gitdir(canary, HOME, admin))
    assert "planted" in said, said

    out = b.kandev("task", "delete", task, "--stop")
    assert out["deleted"] is True and out["stopped"] == [sid], out
    assert out["worktree"] == f"removed; its branch kandev/{task} is kept"
    assert _tree(b, canary) == before  # every canary survives
    assert sorted(b.box.run("ls", "-A", HOME).stdout.split()) == home_before  # the home is whole
    for gone in (ws, admin):  # exactly what was recorded went
        assert b.box.run("test", "-e", gone, check=False).returncode != 0, gone
    assert {ws, admin} <= set(out["removed"]), out
    assert f"kandev/{task}" in _git_in_box(b, repo, "branch", "--list")
    assert ws not in _git_in_box(b, repo, "worktree", "list")
    assert b.kandev("status")["backend"]["state"] == "ready"
    b.kandev("prompt", bystander["session_id"], "still here", "--wait")


def _contained(b: Box, sid: str, bystander: str, outside: str, admin: str) -> None:
    """The new agent of ``sid`` cannot write ``outside``, list ``<home>/sessions`` (nor chmod it open,
    though its uid is the service's) or see the bystander's session directory, and works in its
    workspace, its HOME and its own admin directory (``contained_attempts``)."""
    denied, allowed = contained_attempts(HOME, bystander, outside, admin)
    said = _sh(b, sid, attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    assert _tree(b, outside) == {"precious": "the user's\n"}


def test_issue19_b_a_planted_commondir_never_decides_what_a_new_agent_sees(pkg: Box) -> None:
    """Issue 19 scenario B under the units: a ``.git`` whose ``commondir`` names a directory of the
    kandev user outside the workspace, then the agent exits; ``kandev resume``, ``reset-context
    --restart`` and an automatic resume (``features.auto_resume``, after ``systemctl kill -s KILL
    kandev-agentctl``: the backend starts a new control server and resumes what the loss
    interrupted) each give an agent that cannot write that directory nor list ``<home>/sessions``,
    and works in its own workspace. The configuration is put back afterwards."""
    b = pkg
    conf = b.box.read_file("/etc/kandev/kandev.toml")
    assert "\n#auto_resume = true\n" in conf  # on by default (Issue 46 item 2); written out all the same
    b.box.write_file("/etc/kandev/kandev.toml", conf.replace("\n#auto_resume = true\n", "\nauto_resume = true\n"))
    b.box.systemctl("restart", BACKEND)
    try:
        repo = _hostile_repository(b, "b-repo")
        outside = f"{HOSTILE}/b-outside"
        _as_kandev(b, f"mkdir {outside} && echo \"the user's\" > {outside}/precious")
        bystander = b.kandev("session", "start", b.kandev("task", "create", "--title", "b bystander")["task_id"])
        task, sid = _worktree_session(b, repo, "b attacker")
        admin = f"{repo}/.git/worktrees/{task}"
        said = _sh(b, sid, plant_commondir(outside, admin))
        assert "planted" in said, said
        b.kandev("prompt", sid, "/exit 1")
        assert b.box.wait_for(lambda: (s := b.show(sid))["state"] == "FAILED" and not s["live"], timeout=30)

        b.kandev("resume", sid)
        assert b.box.wait_for(lambda: (s := b.show(sid))["live"] and s["state"] == "WAITING_FOR_INPUT", timeout=60)
        _contained(b, sid, bystander["session_id"], outside, admin)

        pid = b.show(sid)["agent_pid"]
        b.kandev("session", "reset-context", sid, "--restart")
        assert b.box.wait_for(lambda: (s := b.show(sid))["live"] and s["agent_pid"] != pid
                              and s["state"] == "WAITING_FOR_INPUT", timeout=60)
        _contained(b, sid, bystander["session_id"], outside, admin)

        pid, server = b.show(sid)["agent_pid"], b.prop(AGENTCTL, "MainPID")
        b.box.systemctl("kill", "-s", "KILL", AGENTCTL)
        show = b.box.wait_for(lambda: s if (s := b.show(sid))["live"] and s["agent_pid"] != pid
                              and s["state"] == "WAITING_FOR_INPUT" else None, timeout=90)
        assert show, "the session was not resumed automatically"
        assert b.prop(AGENTCTL, "MainPID") not in ("0", server)
        assert [e["SESSION_ID"] for e in b.box.journal_json("KANDEV_EVENT=session_resumed", f"SESSION_ID={sid}")
                if e.get("AUTOMATIC") == "1"], "no automatic resume of the session in the journal"
        _contained(b, sid, bystander["session_id"], outside, admin)
    finally:
        b.box.write_file("/etc/kandev/kandev.toml", conf)
        b.box.systemctl("restart", BACKEND)


def test_issue19_c_the_repository_is_not_the_agents_to_reconfigure(pkg: Box) -> None:
    """Issue 19 scenario C under the units: from a worktree session of a repository of the kandev
    user, writing its config, hooks and info/attributes (and the other ways to reach the next git
    on the host) fails while commit, branch and rebase work; a sibling session's and the user's own
    ``git status`` run nothing; with a filter, attributes, hooks and an fsmonitor planted by the
    user anyway, a new ``task create --executor worktree`` runs none of them outside a sandbox (the
    filter runs, contained, inside one)."""
    b = pkg
    repo = _hostile_repository(b, "c-repo")
    ran = f"{HOSTILE}/c-ran"  # anything that runs outside a sandbox, as kandev or root, leaves a file here
    _as_kandev(b, f"mkdir {ran}")
    task, sid = _worktree_session(b, repo, "c attacker")
    sibling_task, sibling = _worktree_session(b, repo, "c sibling")
    common = f"{repo}/.git"
    denied, allowed = repository_attempts(common, f"{HOME}/worktrees/{task}", ran, sibling_task)
    said = _sh(b, sid, attack_script(denied, allowed))
    assert not attack_verdicts(said, denied, allowed), said
    # The other worktrees' admin entries are an empty tmpfs inside: what is made there stays there.
    _sh(b, sid, f"mkdir {common}/worktrees/planted")
    assert sorted(b.box.run("ls", f"{common}/worktrees").stdout.split()) == sorted([task, sibling_task])
    assert _git_in_box(b, repo, "log", "--format=%s", f"kandev/{task}").split() == ["two", "init"]  # rebased
    assert "feature" in _git_in_box(b, repo, "branch", "--list")
    for absent in ("commondir", "config.worktree"):
        assert b.box.run("test", "-e", f"{common}/{absent}", check=False).returncode != 0, absent

    # A sibling session's and the user's own git status run no fsmonitor (nor anything else).
    said = _sh(b, sibling, "git status --porcelain && echo status-ok")
    assert "status-ok" in said, said
    _as_kandev(b, f"cd {repo} && git status --porcelain && {' '.join(GIT)} commit -q --allow-empty -m users")
    _git_in_box(b, repo, "status", "--porcelain")  # and root's
    assert b.box.run("ls", "-A", ran).stdout.split() == []

    # Planted anyway, by the repository's user (kandev): each leaves a file in ``ran`` if it runs on the host.
    _as_kandev(b, plant_repository(repo, ran, f"{HOSTILE}/c-fsmonitor"))
    created = b.kandev("task", "create", "--title", "c new", "--executor", "worktree", "--workspace", repo)
    new_ws = created["workspace"]
    assert b.box.run("ls", "-A", ran).stdout.split() == []  # nothing ran outside a sandbox
    assert b.box.read_file(f"{new_ws}/README") == "hello\n"
    # The filter did run, inside the checkout's sandbox (where ``ran`` is absent).
    b.box.run("test", "-e", f"{new_ws}/filter-ran-inside-a-sandbox")


CLAUDE_KEY = "sk-ant-box-" + "0123456789abcdef" * 2  # the box's own test key
MOCK_TOKEN = "mock-box-token-42"
STANDIN_PORT = 18080


def test_issue12_e_claude_code_with_its_key_from_a_systemd_credential(pkg: Box, claude_npm_cache: Path) -> None:
    """Issue 12 scenario E: under real systemd with the installed package, Issue 12 scenario A with the key
    from a systemd credential (``secret_env = { ANTHROPIC_API_KEY = "credential:anthropic-api-key" }``
    and ``LoadCredential=`` in an operator's drop-in for kandev-agentctl.service, the key file 0600
    root:root) and the mock's from a 0640 root:kandev file: a real claude-code turn against the
    stand-in (run inside the box: its network is private) completes in order with the key; the key
    is in no file under the home, no journal entry, no argv, no ``session show``, and not in the
    mock agent's view."""
    b = pkg
    box = b.box
    npx = claude_npm_cache / "_npx"
    tree = next(p for p in npx.iterdir() if (p / "node_modules/@zed-industries/claude-code-acp").is_dir())
    # The runtime prepared as `kandev runtime update claude-code` would (the box has no network).
    box.run("mkdir", "-p", f"{HOME}/.npm/_npx")
    box.run("cp", "-a", str(tree), f"{HOME}/.npm/_npx/{tree.name}")
    box.run("chown", "-R", "kandev:kandev", f"{HOME}/.npm")
    record = "/var/tmp/standin.jsonl"
    box.run("systemd-run", "--unit=messages-standin", "--quiet", "/usr/bin/python3",
            str(REPO / "tests/support/messages_standin.py"), "--port", str(STANDIN_PORT), "--record", record,
            "--deltas", json.dumps(["Hello", " from", " the", " box."]))
    box.run("mkdir", "-p", "-m", "0750", "/etc/kandev/secrets")
    box.run("chown", "root:kandev", "/etc/kandev/secrets")
    box.write_file("/etc/kandev/secrets/anthropic-api-key", CLAUDE_KEY + "\n", mode=0o600)
    box.write_file("/etc/kandev/secrets/mock-token", MOCK_TOKEN + "\n", mode=0o640)
    box.run("chown", "root:kandev", "/etc/kandev/secrets/mock-token")
    box.write_file("/etc/systemd/system/kandev-agentctl.service.d/anthropic.conf",
                   "[Service]\nLoadCredential=anthropic-api-key:/etc/kandev/secrets/anthropic-api-key\n")
    conf = box.read_file("/etc/kandev/kandev.toml")
    # the stand-in is on the host's loopback: the agent reaches it through its egress proxy only once
    # its address is listed (Issue 44)
    conf = conf.replace("\n[network]\n", f'\n[network]\nhost_ports = ["127.0.0.1:{STANDIN_PORT}"]\n', 1)
    box.write_file("/etc/kandev/kandev.toml", conf + (
        "\n[agents.claude-code]\n"
        f'env = {{ ANTHROPIC_BASE_URL = "http://127.0.0.1:{STANDIN_PORT}" }}\n'
        'secret_env = { ANTHROPIC_API_KEY = "credential:anthropic-api-key" }\n'
        "\n[agents.mock]\n"
        'secret_env = { MOCK_TOKEN = "/etc/kandev/secrets/mock-token" }\n'), mode=0o644)
    box.systemctl("daemon-reload")
    box.systemctl("restart", BACKEND)  # reads the new configuration, adopts the running control server
    box.wait_for(lambda: b.kandev("status", check=False).get("backend", {}).get("state") == "ready", timeout=60)
    old_ctl = b.prop(AGENTCTL, "MainPID")
    box.systemctl("stop", AGENTCTL)  # the operator's drop-in applies to the next start, by the backend
    assert box.wait_for(lambda: b.prop(AGENTCTL, "MainPID") not in ("0", old_ctl)
                        and b.kandev("status")["control_server"]["state"] == "running", timeout=60)

    task = b.kandev("task", "create", "--title", "claude in the box")["task_id"]
    sid = b.kandev("session", "start", task, "--agent", "claude-code")["session_id"]
    assert b.kandev("prompt", sid, "say hello", "--wait")["stop_reason"] == "end_turn"
    show = b.show(sid)
    assert [c for c in chunks(show) if c] == ["Hello", " from", " the", " box."]
    requests = [json.loads(line) for line in box.read_file(record).splitlines()]
    assert requests and all(r["headers"].get("x-api-key") == CLAUDE_KEY for r in requests)
    # The agent's HOME is its session's own, in the state directory.
    assert box.run("test", "-d", f"{HOME}/sessions/{sid}/agent/home/.claude").returncode == 0

    mtask = b.kandev("task", "create", "--title", "mock in the box")["task_id"]
    msid = b.kandev("session", "start", mtask)["session_id"]
    said = _says(b, msid, "/sh echo env:$(env | grep -c sk-ant-box); "
                 "echo mock:$(printf %s \"$MOCK_TOKEN\" | sha256sum | cut -c1-16); "
                 "cat /etc/kandev/secrets/anthropic-api-key >/dev/null 2>&1 && echo key:readable || echo key:absent")
    assert "env:0" in said and "key:absent" in said, said
    assert f"mock:{hashlib.sha256(MOCK_TOKEN.encode()).hexdigest()[:16]}" in said, said

    box.write_file("/root/needles", f"{CLAUDE_KEY}\n{MOCK_TOKEN}\n", mode=0o600)
    found = box.run("sh", "-c", "grep -rlsFf /root/needles /var/lib/kandev; "
                    "journalctl -o json --no-pager | grep -cFf /root/needles; "
                    "for f in /proc/[0-9]*/cmdline; do grep -lsFf /root/needles $f; done; true").stdout
    assert found.split() == ["0"], found
    for text in (json.dumps(show), json.dumps(b.show(msid)), json.dumps(b.kandev("agents")),
                 box.run("kandev", "session", "show", sid).stdout):
        assert CLAUDE_KEY not in text and MOCK_TOKEN not in text
    agents = {a["name"]: a for a in b.kandev("agents")["agents"]}
    assert agents["claude-code"]["secret_env"] == {"ANTHROPIC_API_KEY": "credential:anthropic-api-key"}
    box.systemctl("stop", "messages-standin")


def test_e_remove_stops_both_and_keeps_state(pkg: Box) -> None:
    b = pkg
    b.apt("remove", "kandev")
    assert b.prop(BACKEND, "ActiveState") in ("inactive", "failed") or b.prop(BACKEND, "LoadState") == "not-found"
    assert b.box.wait_for(lambda: not b.box.alive(S["agent_pid"]), timeout=20), "agent outlived the removal"
    assert b.prop(AGENTCTL, "ActiveState") != "active"
    assert b.box.run("dpkg-query", "-W", "-f", "${Status}", "kandev").stdout == "deinstall ok config-files"
    b.box.run("test", "-f", f"{HOME}/kandev.db")
    b.box.run("getent", "passwd", "kandev")
    b.box.run("test", "-f", "/etc/kandev/kandev.toml")


def test_e_reinstall_keeps_state(pkg: Box) -> None:
    b = pkg
    b.install(b.debs["upgrade_deb"])
    assert b.prop(BACKEND, "ActiveState") == "active"
    show = b.show(S["sid"])
    assert show["task_id"] == S["task"]
    board = b.kandev("board")
    assert any(S["task"] in ids for ids in board.values() if isinstance(ids, list))


def test_e_purge_removes_everything(pkg: Box) -> None:
    b = pkg
    # The operator's own files (the token, Issue 12 E's keys and drop-in): purge leaves files it did not ship.
    b.box.run("rm", "-rf", TOKEN_FILE, "/etc/kandev/secrets", "/etc/systemd/system/kandev-agentctl.service.d")
    b.apt("purge", "kandev")
    assert b.box.run("dpkg-query", "-W", "kandev", check=False).returncode != 0 or \
        b.box.run("dpkg-query", "-W", "-f", "${Status}", "kandev").stdout.startswith("unknown")
    for path in (HOME, "/etc/kandev", "/usr/lib/kandev", "/usr/lib/systemd/system/kandev-backend.service"):
        assert b.box.run("test", "-e", path, check=False).returncode != 0, path
    assert b.box.run("getent", "passwd", "kandev", check=False).returncode != 0
    assert b.box.run("getent", "group", "kandev", check=False).returncode != 0
    assert b.prop(BACKEND, "LoadState") == "not-found"
