"""The agent sandbox: bubblewrap around every agent the control server spawns.

An agent runs arbitrary tool calls, so it is a guest: it sees the files it works on and nothing of
kandev's. The control server wraps the agent's argv in ``bwrap`` (Debian ``bubblewrap``, the
sandbox of Flatpak and of Claude Code on Linux) with a new user, pid and network namespace (and the
mount namespace bwrap always makes; the network namespace and the agent's one way out, its egress
proxy, are ``daemon.agentctl.sandbox.network``'s). The view (``build_argv``):

- a fresh root (tmpfs), read-only once built, where every directory exists only because something
  was bound into it; those directories are traverse-only (the agent reaches its own session
  directory below ``<home>/sessions`` but cannot list ``<home>/sessions`` or anything above it);
- read-only: the system (``/usr``, ``/etc``, ``/opt``, the ``/bin``, ``/lib*``, ``/sbin`` symlinks of
  a merged-usr system or those directories), the Python interpreter's prefixes and kandev's own code
  (the mock agent and the git credential helper run from them), the ``node`` prefix, plus what the
  backend names for this agent (its credential endpoint, a prepared npm runtime);
- read-write: the workspace, the agent's own state directories, a private ``/tmp`` and
  ``/var/tmp``; for a git worktree, what the backend names of its repository from the task's record
  (``daemon.backend.git.workspace_record.repository_view``: the git directory read-only, its
  ``objects``, ``refs``, ``logs`` and the worktree's own admin directory read-write, the other
  worktrees' admin directories masked). Nothing is ever derived from a file in the workspace (a
  ``.git`` file, ``commondir``, ``gitdir``): the agent writes those;
- ``/proc`` of the new pid namespace (the agent's own process tree only) and a minimal ``/dev``;
- absent: everything else. Paths the backend or the server name as *hidden* (the kandev home,
  the token file, the server's own sockets, logs and secrets) are masked (an empty tmpfs, or
  ``/dev/null`` for a file) wherever they lie inside something bound, and stay absent otherwise;
  a path bound *inside* a hidden one (the workspace under ``<home>/worktrees``) stays visible.

The agent is never root, inside or outside: it runs as the host user ``daemon.host.agent_user`` names
(the server's own uid, or ``kandev-agent`` when the server runs as root), with the same uid inside,
and keeps no capability. A server running as root cannot let bwrap make the user namespace itself
(bwrap would map the agent to host uid 0), and an unprivileged bwrap could not reach the paths it
binds below root's private directories. So the server makes the namespace (``make_userns``:
uid/gid 0 mapped to root for the set-up, the agent's uid to ``kandev-agent``), bwrap joins it
(``--userns``) and mounts as root of that namespace, and ``setpriv`` switches to the agent's uid,
clears every capability (bounding set included) and sets no-new-privileges before the agent runs.
Only bwrap's reaper (pid 1 inside) keeps host uid 0; nothing inside can signal, trace or read it.
Each agent has its own IPC namespace (``--unshare-ipc``: no SysV shared memory, semaphores or
message queues shared with another sandbox) and bwrap's ``/proc`` keeps ``/proc/sys`` read-only.
Every sandbox also gets the agents' system-call filter (``--seccomp``, built by
``daemon.agentctl.sandbox.seccomp_filter``): no namespace of its own, no io_uring, no keyring, no
``bpf``, no mount; bwrap loads it just before it executes the command.

The process cap (``agents.max_processes``) is the agent's ``RLIMIT_NPROC``, set on bwrap and
inherited: the kernel counts it per user namespace and uid, so it bounds the processes of one
agent's sandbox, whatever other agents of the same uid run (see docs/architecture.md).

Process handling is unchanged: the ``bwrap`` process is the agent's process-group leader (its pid
and start time are the agent's identity), ``--die-with-parent`` ties the sandbox to it and our
``PR_SET_PDEATHSIG`` ties it to the server, and every process inside stays in that process group,
so stop-kills-the-group kills the whole sandbox (and the pid namespace dies with its init).
``--new-session`` is deliberately not used: it would move the agent out of the group (the agent has
no controlling terminal, so ``TIOCSTI`` is no threat). ``bwrap`` itself ends at once on SIGTERM and
would take the agent down with it, so it is started with SIGTERM ignored and the agent is run
through ``env --default-signal=TERM``: the agent still gets SIGTERM first and ``KILL_GRACE`` to
exit, then SIGKILL reaches every process of the group.

``daemon.agentctl.sandbox.probe`` checks, off the event loop, that a sandbox can be made here
(bwrap on the PATH, user namespaces allowed, a /proc mount admitted) and says why not.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
import signal
import stat
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.agentctl.sandbox import network, seccomp_filter
from daemon.agentctl.sandbox.network import SandboxNet
from daemon.agentctl.sandbox.userns import make_userns
from daemon.host.agent_user import AgentUser, agent_user
from ipc.errors import ErrorCode, IpcError

BWRAP = "bwrap"
SANDBOX_UNAVAILABLE = ErrorCode.SANDBOX_UNAVAILABLE
"""The error code of a launch refused because the sandbox cannot be made (``agents.sandbox = required``)."""
SETPRIV = "/usr/bin/setpriv"
PROBE_TIMEOUT_S = 10.0
SYSTEM_DIRS = ("/usr", "/etc", "/opt")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PRIVATE_TMP = ("/tmp", "/var/tmp")
TRAVERSE_ONLY = "0111"  # the mode of the directories the sandbox makes to lead to a mount point
RESOLV_CONF = "/etc/resolv.conf"
PRLIMIT = "/usr/bin/prlimit"
_MAX_PATHS = 64
MAX_PROCESSES_DEFAULT = 4096
MAX_PROCESSES_RANGE = (64, 65536)


class SandboxPolicy(str, enum.Enum):
    """``agents.sandbox``: ``required`` (default) or ``off``."""

    REQUIRED = "required"
    OFF = "off"


def unavailable(reason: str) -> IpcError:
    """The typed refusal of a launch that needs a sandbox this host cannot make."""
    return IpcError(
        SANDBOX_UNAVAILABLE,
        f"the agent sandbox cannot be made: {reason}; agents.sandbox = \"required\" refuses to start"
        " an agent without it (install bubblewrap and allow user namespaces, or set"
        " agents.sandbox = \"off\" to run agents unsandboxed)",
        retryable=False,
    )


# ---------------------------------------------------------------- what the backend asks for


def _bad(message: str) -> IpcError:
    return IpcError(ErrorCode.INVALID_ARGUMENT, f"the agent's sandbox cannot be made as asked: {message}")


def _paths(doc: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = doc.get(key, [])
    if not isinstance(value, list) or len(value) > _MAX_PATHS:
        raise _bad(f"'{key}' must be a list of at most {_MAX_PATHS} absolute paths")
    for item in value:
        if not isinstance(item, str) or not item or "\0" in item or not os.path.isabs(item):
            raise _bad(f"'{key}' must hold absolute paths without NUL (got {item!r:.100})")
    return tuple(value)


@dataclass(frozen=True)
class SandboxRequest:
    """What one launch asks for: the policy, and the paths of this agent beyond the system view.

    ``writable``: read-write binds (the workspace is added from ``cwd``);
    ``readonly``: read-only binds; ``hidden``: paths that must stay invisible even where they lie
    inside a bound directory. A missing path is skipped (a hidden one is then absent anyway)."""

    policy: SandboxPolicy = SandboxPolicy.REQUIRED
    writable: tuple[str, ...] = ()
    readonly: tuple[str, ...] = ()
    hidden: tuple[str, ...] = ()
    max_processes: int = MAX_PROCESSES_DEFAULT  # the agent's RLIMIT_NPROC (agents.max_processes)

    def to_wire(self) -> dict[str, Any]:
        return {"policy": self.policy.value, "writable": list(self.writable), "readonly": list(self.readonly),
                "hidden": list(self.hidden), "max_processes": self.max_processes}

    @classmethod
    def from_wire(cls, doc: Any) -> SandboxRequest:
        """Parse ``create_instance``'s ``sandbox`` field; absent means ``required`` with nothing extra."""
        if doc is None:
            return cls()
        if not isinstance(doc, dict):
            raise _bad("must be a map")
        unknown = sorted(set(doc) - {"policy", "writable", "readonly", "hidden", "max_processes"})
        if unknown:
            raise _bad(f"unknown field(s) {unknown}")
        try:
            policy = SandboxPolicy(doc.get("policy", SandboxPolicy.REQUIRED.value))
        except ValueError:
            raise _bad(f"'policy' must be 'required' or 'off' (got {doc.get('policy')!r:.50})") from None
        nproc = doc.get("max_processes", MAX_PROCESSES_DEFAULT)
        low, high = MAX_PROCESSES_RANGE
        if not isinstance(nproc, int) or isinstance(nproc, bool) or not low <= nproc <= high:
            raise _bad(f"'max_processes' must be an integer in {low}..{high} (got {nproc!r:.50})")
        return cls(policy, _paths(doc, "writable"), _paths(doc, "readonly"), _paths(doc, "hidden"), nproc)


# ---------------------------------------------------------------- can a sandbox be made here?


@dataclass(frozen=True)
class SandboxSupport:
    """Whether this process can sandbox agents, and why not."""

    available: bool
    reason: str | None = None
    bwrap: str | None = None
    version: str | None = None
    mechanism: str = "bubblewrap"
    seccomp: str | None = None
    """The agents' system-call filter (``seccomp_filter.describe``; None: it cannot be built)."""
    ipc_namespace: bool = True
    """Whether each agent gets its own IPC namespace. False only where this process may not make
    one (a control server reloaded in place under an older unit whose ``RestrictNamespaces=`` has
    no ``ipc``): agents are still sandboxed, and ``reason`` says what is missing and the fix."""
    network_namespace: bool = True
    """Whether each agent can get a network namespace of its own (``daemon.agentctl.sandbox.network``);
    without one no agent is started (``available`` is False and ``reason`` says why)."""

    def to_wire(self) -> dict[str, Any]:
        return {"available": self.available, "reason": self.reason, "mechanism": self.mechanism,
                "bwrap": self.bwrap, "version": self.version, "seccomp": self.seccomp,
                "ipc_namespace": self.ipc_namespace, "network_namespace": self.network_namespace}


def find_bwrap(env: Mapping[str, str] | None = None) -> str | None:
    """``bwrap`` on the PATH (ours, as the unit sets it), resolved to an absolute path."""
    path = (os.environ if env is None else env).get("PATH", os.defpath)
    found = shutil.which(BWRAP, path=path)
    return os.path.abspath(found) if found else None


def ignore_sigterm() -> None:
    """``preexec_fn`` part: bwrap (and its init in the new pid namespace) ignore SIGTERM; the agent
    gets the default action back from ``env --default-signal=TERM``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---------------------------------------------------------------- the view


class BindMode(str, enum.Enum):
    READONLY = "ro"
    WRITABLE = "rw"


@dataclass(frozen=True)
class Bind:
    path: str  # absolute and resolved (bound at the same path inside)
    mode: BindMode


@dataclass(frozen=True)
class SandboxView:
    """Everything ``build_argv`` needs: pure data, built from the host by ``host_view``."""

    bwrap: str
    uid: int
    gid: int
    binds: tuple[Bind, ...]
    cwd: str
    env_tool: str = "/usr/bin/env"
    links: tuple[tuple[str, str], ...] = ()  # (target, path): a symlink of the system, e.g. usr/bin -> /bin
    hidden: tuple[str, ...] = ()  # resolved paths to mask where a bind reveals them
    hidden_files: frozenset[str] = field(default_factory=frozenset)  # which of ``hidden`` are not directories
    own_userns: bool = False  # the server (root) makes the user namespace: ``make_userns``, then setpriv
    max_processes: int = MAX_PROCESSES_DEFAULT
    own_ipc: bool = True  # ``--unshare-ipc`` (see ``SandboxSupport.ipc_namespace``)
    net: SandboxNet | None = None  # the agent's own network namespace and its way out (``network``)


def sandbox_ids() -> tuple[int, int]:
    """The uid/gid the agent has, inside its sandbox and on the host (``daemon.host.agent_user``)."""
    user = agent_user()
    return user.uid, user.gid


def _covered(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _inside(path: str, root: str) -> bool:
    """``path`` equals ``root`` or lies below it (both absolute and normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def system_binds() -> tuple[Bind, ...]:
    """The read-only system directories that exist here (symlinked ones are ``system_links``)."""
    out = []
    for d in SYSTEM_DIRS + SYSTEM_LINKS:
        if os.path.isdir(d) and not os.path.islink(d):
            out.append(Bind(os.path.realpath(d), BindMode.READONLY))
    return tuple(out)


def system_links() -> tuple[tuple[str, str], ...]:
    """The ``/bin -> usr/bin`` style symlinks of a merged-usr system, recreated inside."""
    return tuple((os.readlink(d), d) for d in SYSTEM_LINKS if os.path.islink(d))


def runtime_paths(env: Mapping[str, str] | None = None) -> list[str]:
    """What the agents' runtimes need read-only besides the system: this interpreter's prefixes and
    import path (the mock agent and the git helper run with it, kandev's own code included) and the
    prefix of ``node`` on the PATH."""
    import daemon

    paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             str(Path(daemon.__file__).resolve().parent.parent)}
    # The import path, but never the root nor the working directory: ``python -m``/``-c`` put the
    # working directory first (``/`` for a systemd unit), and binding it would show the agent the
    # whole filesystem (the servers start with -P; this holds whatever started them).
    never = {"/", os.getcwd()}
    paths.update(p for p in sys.path if p and os.path.isabs(p) and os.path.normpath(p) not in never)
    node = shutil.which("node", path=(os.environ if env is None else env).get("PATH", os.defpath))
    if node:
        paths.add(str(Path(node).resolve().parent.parent))
    return sorted(paths)


def _root_only_in_etc(limit: int = 20000) -> list[str]:
    """Entries under /etc that others may not read (only meaningful for a server running as root,
    whose agents keep kuid 0 outside their namespace and so pass owner checks)."""
    found: list[str] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk("/etc"):
        for name in dirnames + filenames:
            seen += 1
            if seen > limit:
                return found
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            if not st.st_mode & stat.S_IROTH:
                found.append(p)
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in found]
    return found


_ROOT_ONLY_CACHE: list[str] | None = None


def root_only_system_paths() -> list[str]:
    global _ROOT_ONLY_CACHE
    if _ROOT_ONLY_CACHE is None:
        _ROOT_ONLY_CACHE = _root_only_in_etc()
    return list(_ROOT_ONLY_CACHE)


def host_view(
    request: SandboxRequest,
    cwd: str,
    *,
    bwrap: str,
    extra_hidden: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    user: AgentUser | None = None,
) -> SandboxView:
    """The view of one agent on this host (reads the file system: call it off the event loop).

    Every path is resolved (symlinks followed) and bound at its resolved path; missing ones are
    skipped. ``cwd`` (the workspace) is writable; nothing is derived from what it holds (a git
    worktree's repository is bound as the backend names it, from its record). ``user``: who runs
    inside (default: the agents' user, ``agent_user``)."""
    binds: dict[str, BindMode] = {b.path: b.mode for b in system_binds()}
    resolv = os.path.realpath(RESOLV_CONF)
    if os.path.exists(resolv) and not _covered(resolv, binds):
        binds[resolv] = BindMode.READONLY  # e.g. /run/systemd/resolve/stub-resolv.conf
    for p in runtime_paths(env):
        rp = os.path.realpath(p)
        if os.path.exists(rp) and not _covered(rp, [b for b, m in binds.items() if m is BindMode.READONLY]):
            binds[rp] = BindMode.READONLY
    for p in request.readonly:
        rp = os.path.realpath(p)
        if os.path.exists(rp):
            binds.setdefault(rp, BindMode.READONLY)
    workspace = os.path.realpath(cwd)
    for p in (workspace, *request.writable):
        rp = os.path.realpath(p)
        if os.path.exists(rp):
            binds[rp] = BindMode.WRITABLE
    hidden_in = [*request.hidden, *extra_hidden]
    if os.geteuid() == 0:
        hidden_in += root_only_system_paths()
    hidden: list[str] = []
    files: set[str] = set()
    for p in hidden_in:
        rp = os.path.realpath(p)
        if not os.path.lexists(rp) or rp in hidden:
            continue
        hidden.append(rp)
        if not os.path.isdir(rp):
            files.add(rp)
    user = agent_user() if user is None else user
    return SandboxView(
        bwrap=bwrap, uid=user.uid, gid=user.gid, cwd=workspace,
        binds=tuple(Bind(p, m) for p, m in sorted(binds.items())),
        env_tool=shutil.which("env", path="/usr/bin:/bin") or "/usr/bin/env",
        links=system_links(), hidden=tuple(hidden), hidden_files=frozenset(files),
        own_userns=user.dedicated, max_processes=request.max_processes,
    )


def _revealed(path: str, bound: Sequence[str], hidden: Sequence[str]) -> bool:
    """Whether ``path`` would be visible without its own mask: the deepest bind at or above it is
    deeper than every other hidden path above it (a mask at the same path as a bind wins)."""
    binds = [b for b in bound if _inside(path, b)]
    if not binds:
        return False
    masks = [h for h in hidden if h != path and _inside(path, h)]
    return not masks or max(map(len, binds)) > max(map(len, masks))


def _ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, but not ``/``."""
    out = []
    while path not in ("/", ""):
        out.append(path)
        path = os.path.dirname(path)
    return out


def _depth(path: str) -> int:
    return 0 if path == "/" else path.rstrip("/").count("/")


def build_argv(view: SandboxView, command: Sequence[str], userns: tuple[int, int] | None = None, *,
               seccomp: int | None = None) -> list[str]:
    """The ``bwrap`` command line that runs ``command`` in ``view`` (pure; see the module docstring);
    ``userns``: the namespaces ``make_userns`` made, for a view with ``own_userns``; ``seccomp``: the
    descriptor of the agents' system-call filter (``seccomp_filter.program_fd``), which bwrap loads
    just before it executes the command.

    Mount operations run in order of path depth, so a bind inside another one and a mask inside a
    bind both come after it; at the same path a mask comes after the bind (the mask wins). A hidden
    path is masked only where a bind reveals it (it is absent from the fresh root otherwise)."""
    if not command:
        raise ValueError("an empty command")
    if "=" in command[0]:
        raise ValueError(f"the agent's command {command[0]!r} contains '=' (env would take it for a variable)")
    ipc = ["--unshare-ipc"] if view.own_ipc else []
    ipc += network.bwrap_args(view.net)
    if view.own_userns:
        if userns is None:
            raise ValueError("a view with its own user namespace needs the namespaces' descriptors")
        argv = [view.bwrap, "--userns", str(userns[0]), "--userns2", str(userns[1]), "--unshare-pid", *ipc, "--uid", "0", "--gid", "0",
                "--die-with-parent", "--cap-drop", "ALL",
                "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        become = [SETPRIV, f"--reuid={view.uid}", f"--regid={view.gid}", "--clear-groups", "--inh-caps=-all",
                  "--bounding-set=-all", "--no-new-privs", "--"]
    else:
        argv = [view.bwrap, "--unshare-user", "--unshare-pid", *ipc,
                "--uid", str(view.uid), "--gid", str(view.gid), "--die-with-parent", "--cap-drop", "ALL"]
        become = []
    # The process cap, set inside: the kernel then counts it in this sandbox's user namespace only.
    cap = [PRLIMIT, f"--nproc={view.max_processes}:{view.max_processes}", "--"]
    if seccomp is not None:
        argv += ["--seccomp", str(seccomp)]
    for target, path in view.links:
        argv += ["--symlink", target, path]
    ops: list[tuple[int, int, str, list[str]]] = []  # (depth, order at equal depth, path, args)
    for tmp in PRIVATE_TMP:  # before any bind below them (a workspace under /var/tmp)
        ops.append((_depth(tmp), -1, tmp, ["--tmpfs", tmp]))
    for bind in view.binds:
        flag = "--bind" if bind.mode is BindMode.WRITABLE else "--ro-bind"
        ops.append((_depth(bind.path), 0, bind.path, [flag, bind.path, bind.path]))
    bound = [b.path for b in view.binds]
    for h in view.hidden:
        if not _revealed(h, bound, view.hidden):
            continue  # absent already (nothing binds it, or a mask above it hides it)
        mask = ["--ro-bind", "/dev/null", h] if h in view.hidden_files else ["--tmpfs", h]
        ops.append((_depth(h), 1, h, mask))
    for depth, order, _path, args in sorted(ops, key=lambda op: (op[0], op[1], op[2])):
        del depth, order
        argv += args
    # The directories bwrap made in the sandbox's own root (tmpfs) only to lead to a mount point
    # (``<home>/sessions`` above a session's directory, say) are traverse-only: the agent reaches
    # what is bound below them but lists none of them (never a directory of the host inside
    # something bound). The root is remounted read-only at the end, so an agent that owns them (a
    # server not running as root: bwrap made them as the agent's uid) cannot open them again.
    mounted = [p for _d, _o, p, _a in ops]
    parents = {os.path.dirname(p.rstrip("/")) for p in mounted}
    ancestors = {a for p in parents for a in _ancestors(p)}
    for d in sorted(ancestors, key=_depth):
        if not _covered(d, bound) and d not in PRIVATE_TMP:
            argv += ["--chmod", TRAVERSE_ONLY, d]
    for tmp in PRIVATE_TMP:  # the agent's own /tmp and /var/tmp, like any system's
        argv += ["--chmod", "1777", tmp]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/"]
    if view.own_userns:
        # bwrap changes directory without its capabilities, as root of the namespace, which may not
        # enter a workspace of the agent's: env does it once the agent's uid is in force.
        # the namespaces' descriptors bwrap inherited are closed before the agent runs
        close = [os.path.realpath(sys.executable), "-I", "-S", "-c", "import os, sys; os.closerange(3, 1 << 20);"
                 " os.execv(sys.argv[1], sys.argv[1:])"]
        argv += ["--chdir", "/", "--", *become, *cap, *close, *network.command_prefix(view.net), view.env_tool,
                 f"--chdir={view.cwd}", "--default-signal=TERM", *command]
    else:
        argv += ["--chdir", view.cwd, "--", *cap, *network.command_prefix(view.net), view.env_tool,
                 "--default-signal=TERM", *command]
    return argv


@dataclass(frozen=True)
class Launch:
    """A sandboxed agent's argv and the descriptors its bwrap must inherit (the user namespaces,
    the system-call filter)."""

    argv: list[str]
    fds: tuple[int, ...] = ()


def wrap_command(
    request: SandboxRequest,
    command: Sequence[str],
    cwd: str,
    *,
    bwrap: str,
    extra_hidden: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    own_ipc: bool = True,
    net: SandboxNet | None = None,
    user: AgentUser | None = None,
) -> Launch:
    """``build_argv(host_view(...), command)`` with the user namespaces it needs and the agents'
    system-call filter (the caller passes ``fds`` to bwrap and closes them). Blocking: call it off
    the event loop. ``own_ipc``: the probe's ``SandboxSupport.ipc_namespace``; ``net``: the agent's
    network namespace and its way out (every agent the control server starts has one; None shares
    the host's network, for the backend's checkout sandbox only); ``user``: who runs inside (default
    the agents' user; runtime preparation runs as the backend's own, ``AgentUser(dedicated=False)``)."""
    hidden_ok(request, cwd, extra_hidden)
    view = host_view(request, cwd, bwrap=bwrap, extra_hidden=extra_hidden, env=env, user=user)
    view = dataclasses.replace(view, own_ipc=own_ipc, net=net)
    try:
        fds: tuple[int, ...] = (seccomp_filter.program_fd(),)
    except seccomp_filter.SeccompUnavailable as exc:
        raise unavailable(str(exc)) from None
    try:
        userns = make_userns(AgentUser(view.uid, view.gid, "", True)) if view.own_userns else None
        fds += userns or ()
        return Launch(build_argv(view, command, userns, seccomp=fds[0]), fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def hidden_ok(request: SandboxRequest, cwd: str, extra_hidden: Sequence[str] = ()) -> None:
    """Refuse a workspace that is itself a hidden path (the agent would see it emptied). A workspace
    that *contains* a hidden path is fine: that path is masked inside it."""
    workspace = os.path.realpath(cwd)
    for h in (*request.hidden, *extra_hidden):
        if os.path.realpath(h) == workspace:
            raise IpcError(ErrorCode.INVALID_ARGUMENT, f"the workspace {cwd} is a path agents may"
                           " not see (the kandev home, a secret); give the task its own directory")
