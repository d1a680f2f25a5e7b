"""The agent sandbox's command line (daemon.agentctl.sandbox.bubblewrap.build_argv) and its request parsing.

Issue 10 scenario A depends on these rules: what a bind reveals is masked when it must stay hidden
(the kandev home under a bound checkout, the token file under /etc, a hidden path under the
workspace), and what is bound inside a hidden path (the workspace under <home>/worktrees) stays
visible. The order of bwrap's mount operations decides all of that, so the tests read the order.
"""

from __future__ import annotations

import dataclasses
import os
import pwd

import pytest

from daemon.agentctl.sandbox.bubblewrap import (
    Bind,
    BindMode,
    SandboxPolicy,
    SandboxRequest,
    SandboxView,
    build_argv,
    hidden_ok,
    runtime_paths,
    sandbox_ids,
)
from ipc.errors import IpcError

RO, RW = BindMode.READONLY, BindMode.WRITABLE


def view(binds: list[tuple[str, BindMode]], hidden: tuple[str, ...] = (), files: frozenset[str] = frozenset(),
         cwd: str = "/ws") -> SandboxView:
    return SandboxView(bwrap="/usr/bin/bwrap", uid=1000, gid=1000, binds=tuple(Bind(p, m) for p, m in binds),
                       cwd=cwd, links=(("usr/bin", "/bin"),), hidden=hidden, hidden_files=files)


def mounts(argv: list[str]) -> list[tuple[str, ...]]:
    """The mount operations in order: (flag, dest) for binds and masks, (flag, dest) for tmpfs."""
    out: list[tuple[str, ...]] = []
    i = 0
    while i < len(argv) and argv[i] != "--":
        a = argv[i]
        if a in ("--bind", "--ro-bind"):
            out.append((a, argv[i + 1], argv[i + 2]))
            i += 3
        elif a in ("--tmpfs", "--proc", "--dev", "--chdir"):
            out.append((a, argv[i + 1]))
            i += 2
        elif a in ("--uid", "--gid", "--cap-drop"):
            i += 2
        elif a == "--symlink":
            out.append((a, argv[i + 1], argv[i + 2]))
            i += 3
        else:
            i += 1
    return out


def index(ops: list[tuple[str, ...]], op: tuple[str, ...]) -> int:
    assert op in ops, (op, ops)
    return ops.index(op)


def test_namespaces_identity_and_the_command() -> None:
    """Issue 10 scenario A: user and pid namespaces (mount is implied), a non-root uid, no
    capabilities, tied to its parent, never --new-session (the agent must stay in the process group
    the control server kills); the agent gets SIGTERM's default action back through env."""
    argv = build_argv(view([("/usr", RO), ("/ws", RW)]), ["/usr/bin/python3", "-m", "daemon.agents.mock"])
    assert argv[0] == "/usr/bin/bwrap"
    for flag in ("--unshare-user", "--unshare-pid", "--die-with-parent"):
        assert flag in argv
    assert "--new-session" not in argv and "--unshare-net" not in argv and "--share-net" not in argv
    assert argv[argv.index("--uid") + 1] == "1000" and argv[argv.index("--cap-drop") + 1] == "ALL"
    tail = argv[argv.index("--") + 1:]
    assert tail == ["/usr/bin/prlimit", "--nproc=4096:4096", "--",
                    "/usr/bin/env", "--default-signal=TERM", "/usr/bin/python3", "-m", "daemon.agents.mock"]
    ops = mounts(argv)
    assert ("--proc", "/proc") in ops and ("--dev", "/dev") in ops and ops[-1] == ("--chdir", "/ws")
    assert ("--bind", "/ws", "/ws") in ops and ("--ro-bind", "/usr", "/usr") in ops
    assert ("--tmpfs", "/tmp") in ops and ("--tmpfs", "/var/tmp") in ops


def test_a_home_inside_a_bound_checkout_is_masked_after_the_bind() -> None:
    """Issue 10 scenario A: a development checkout bound read-only that holds the kandev home (and a
    workspace inside that home): the home is masked after the checkout is bound, and the workspace
    bound after the mask, so the agent sees its workspace and nothing else of the home."""
    argv = build_argv(view([("/src/kandev", RO), ("/src/kandev/.home/worktrees/t1", RW)],
                           hidden=("/src/kandev/.home",), cwd="/src/kandev/.home/worktrees/t1"), ["agent"])
    ops = mounts(argv)
    checkout = index(ops, ("--ro-bind", "/src/kandev", "/src/kandev"))
    mask = index(ops, ("--tmpfs", "/src/kandev/.home"))
    workspace = index(ops, ("--bind", "/src/kandev/.home/worktrees/t1", "/src/kandev/.home/worktrees/t1"))
    assert checkout < mask < workspace


def test_a_workspace_holding_the_home_gets_the_home_masked() -> None:
    """Issue 10 scenario A: a workspace that contains the kandev home (e.g. --workspace /srv with the
    home at /srv/kandev) is writable, and the home inside it is masked after it."""
    ops = mounts(build_argv(view([("/srv", RW)], hidden=("/srv/kandev",), cwd="/srv"), ["agent"]))
    assert index(ops, ("--bind", "/srv", "/srv")) < index(ops, ("--tmpfs", "/srv/kandev"))


def test_a_hidden_file_inside_a_bind_is_covered_with_dev_null() -> None:
    """Issue 10 scenario A: the configured token file under the read-only /etc is replaced by
    /dev/null (a directory would get an empty tmpfs)."""
    ops = mounts(build_argv(view([("/etc", RO), ("/ws", RW)], hidden=("/etc/kandev/github-token",),
                                 files=frozenset({"/etc/kandev/github-token"})), ["agent"]))
    assert index(ops, ("--ro-bind", "/etc", "/etc")) < index(
        ops, ("--ro-bind", "/dev/null", "/etc/kandev/github-token"))


def test_hidden_paths_nothing_reveals_are_not_mounted_at_all() -> None:
    """A hidden path outside every bind is absent from the fresh root already: no mount for it (so
    it cannot appear as an empty directory either); one under another mask needs no mask of its own."""
    ops = mounts(build_argv(view([("/usr", RO), ("/ws", RW)], hidden=("/var/lib/kandev", "/root/token"),
                                 files=frozenset({"/root/token"})), ["agent"]))
    assert not [op for op in ops if "/var/lib/kandev" in op or "/root/token" in op]
    ops = mounts(build_argv(view([("/src", RO)], hidden=("/src/home", "/src/home/secrets/x"),
                                 files=frozenset({"/src/home/secrets/x"})), ["agent"]))
    assert ("--tmpfs", "/src/home") in ops
    assert not [op for op in ops if "/src/home/secrets/x" in op]


def test_a_mask_at_the_same_path_as_a_bind_wins() -> None:
    """A path that is both bound and hidden ends up masked (the mask comes after the bind)."""
    ops = mounts(build_argv(view([("/data", RO)], hidden=("/data",)), ["agent"]))
    assert index(ops, ("--ro-bind", "/data", "/data")) < index(ops, ("--tmpfs", "/data"))


def test_a_workspace_under_var_tmp_is_bound_after_the_private_tmp() -> None:
    """The private /var/tmp must not cover a workspace below it (the tests' homes live there)."""
    ops = mounts(build_argv(view([("/var/tmp/kd-1/home/worktrees/t", RW)], cwd="/var/tmp/kd-1/home/worktrees/t"),
                            ["agent"]))
    assert index(ops, ("--tmpfs", "/var/tmp")) < index(
        ops, ("--bind", "/var/tmp/kd-1/home/worktrees/t", "/var/tmp/kd-1/home/worktrees/t"))


def test_readonly_inside_writable_and_writable_inside_readonly_follow_depth() -> None:
    ops = mounts(build_argv(view([("/ws", RW), ("/ws/.venv", RO), ("/opt", RO), ("/opt/cache/x", RW)]), ["agent"]))
    assert index(ops, ("--bind", "/ws", "/ws")) < index(ops, ("--ro-bind", "/ws/.venv", "/ws/.venv"))
    assert index(ops, ("--ro-bind", "/opt", "/opt")) < index(ops, ("--bind", "/opt/cache/x", "/opt/cache/x"))


def test_a_command_env_would_misread_is_refused() -> None:
    with pytest.raises(ValueError):
        build_argv(view([("/ws", RW)]), ["A=B"])
    with pytest.raises(ValueError):
        build_argv(view([("/ws", RW)]), [])


def test_the_workspace_may_not_be_a_hidden_path(tmp_path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    with pytest.raises(IpcError) as info:
        hidden_ok(SandboxRequest(hidden=(str(home),)), str(home))
    assert info.value.code == "invalid_argument"
    hidden_ok(SandboxRequest(hidden=(str(home),)), str(tmp_path))  # containing it is fine: it is masked


def test_request_parsing() -> None:
    assert SandboxRequest.from_wire(None) == SandboxRequest(SandboxPolicy.REQUIRED)
    req = SandboxRequest.from_wire({"policy": "off", "writable": ["/a"], "readonly": ["/b"], "hidden": ["/c"]})
    assert req == SandboxRequest(SandboxPolicy.OFF, ("/a",), ("/b",), ("/c",))
    assert SandboxRequest.from_wire(req.to_wire()) == req
    for bad in ({"policy": "maybe"}, {"writable": ["relative"]}, {"hidden": "/x"}, {"other": 1}, [],
                {"readonly": ["/a\0b"]}, {"writable": ["/x"] * 65}):
        with pytest.raises(IpcError) as info:
            SandboxRequest.from_wire(bad)
        assert info.value.code == "invalid_argument"


def test_the_agent_is_never_root_inside() -> None:
    """Issue 10, Issue 19 D: our uid when we are not root; as root, kandev-agent's - never 0."""
    uid, gid = sandbox_ids()
    assert uid != 0 and gid != 0
    if os.geteuid() == 0:
        assert (uid, gid) == (pwd.getpwnam("kandev-agent").pw_uid, pwd.getpwnam("kandev-agent").pw_gid)


def test_a_root_server_prepares_the_namespace_and_setpriv_drops_to_the_agent() -> None:
    """Issue 19 D: as root, bwrap joins the namespace the server made and setpriv switches to the
    agent's uid with every capability cleared; Issue 21 A: prlimit sets the process cap inside;
    Issue 21 D: its own IPC namespace either way."""
    v = dataclasses.replace(view([("/ws", RW)]), own_userns=True, max_processes=200)
    with pytest.raises(ValueError):
        build_argv(v, ["agent"])
    argv = build_argv(v, ["agent"], (7, 8))
    assert argv[argv.index("--userns") + 1] == "7" and argv[argv.index("--userns2") + 1] == "8"
    assert "--unshare-user" not in argv and "--unshare-ipc" in argv
    tail = argv[argv.index("--") + 1:]
    assert tail[:8] == ["/usr/bin/setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--inh-caps=-all",
                        "--bounding-set=-all", "--no-new-privs", "--"]
    assert tail[8:11] == ["/usr/bin/prlimit", "--nproc=200:200", "--"]
    assert "os.closerange(3" in " ".join(tail[11:])  # the namespaces' descriptors never reach the agent
    assert tail[-4:] == ["/usr/bin/env", "--chdir=/ws", "--default-signal=TERM", "agent"]
    assert "--unshare-ipc" in build_argv(view([("/ws", RW)]), ["agent"])


def test_the_import_path_never_brings_the_root_or_the_working_directory_into_a_sandbox(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 10 A: a control server started with ``python -m`` in a unit's working directory ``/``
    had ``/`` first on its import path, and its agents then saw the whole filesystem read-only.
    Neither the root nor the working directory is ever bound, whatever the import path says."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/", str(tmp_path), *sys.path])
    paths = runtime_paths({"PATH": "/usr/bin:/bin"})
    assert "/" not in paths and str(tmp_path) not in paths
    assert sys.prefix in paths  # the interpreter is still there


def test_servers_start_without_the_working_directory_on_their_import_path() -> None:
    """The same at the source: the backend's child server and a re-exec run ``python -P``."""
    from daemon.agentctl.reload.reexec import entry_argv
    from daemon.backend.control.launcher import agentctl_argv

    assert agentctl_argv("/h/launch.json")[1] == "-P"
    assert "-P" in entry_argv("--reload")[1:entry_argv("--reload").index("-m")]


def test_a_server_that_may_not_make_an_ipc_namespace_still_sandboxes_without_one() -> None:
    """Issue 21 D, after an upgrade: a control server reloaded in place keeps its older unit's
    RestrictNamespaces= (no ipc); its probe then finds sandboxes without an IPC namespace, says so,
    and launches build exactly that, nothing else dropped."""
    full = build_argv(view([("/ws", RW)]), ["agent"])
    reduced = build_argv(dataclasses.replace(view([("/ws", RW)]), own_ipc=False), ["agent"])
    assert "--unshare-ipc" not in reduced and [a for a in full if a != "--unshare-ipc"] == reduced
    owned = dataclasses.replace(view([("/ws", RW)]), own_userns=True, own_ipc=False)
    argv = build_argv(owned, ["agent"], (7, 8))
    assert "--unshare-ipc" not in argv and "--unshare-pid" in argv and "--userns2" in argv


def test_the_directories_leading_to_a_bind_are_traverse_only_and_the_root_read_only() -> None:
    """Issue 19 scenario B: bwrap makes ``<home>/sessions`` (and every directory above it) in the
    sandbox's own root only to reach the session's directory: the agent may pass through them but
    list none, and the root is remounted read-only after every mount, so an agent that owns those
    directories (a server not running as root) cannot make them readable again."""
    for own_userns in (False, True):
        v = dataclasses.replace(view([("/usr", RO), ("/srv/kd/sessions/s1", RW), ("/ws", RW)]), own_userns=own_userns)
        argv = build_argv(v, ["agent"], (3, 4) if own_userns else None)
        head = argv[:argv.index("--")]
        chmods = {head[i + 2]: head[i + 1] for i, a in enumerate(head) if a == "--chmod"}
        for d in ("/srv", "/srv/kd", "/srv/kd/sessions"):
            assert chmods[d] == "0111", (d, chmods)
        assert "/srv/kd/sessions/s1" not in chmods and "/usr" not in chmods and "/ws" not in chmods
        assert chmods["/tmp"] == chmods["/var/tmp"] == "1777"
        assert head[-2:] == ["--remount-ro", "/"] or head[-4:-2] == ["--remount-ro", "/"], head[-6:]
        # the root goes read-only after the last mount (binds, masks, /proc, /dev)
        last_mount = max(i for i, a in enumerate(head) if a in ("--bind", "--ro-bind", "--tmpfs", "--proc", "--dev"))
        assert head.index("--remount-ro") > last_mount
