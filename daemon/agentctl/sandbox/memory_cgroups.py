"""Each agent's memory bound: a memory cgroup of its own, below the control server's.

Where agents' cgroups go is decided once per process image from kandev's own record, never from
anything an agent can write: the control server's own cgroup (``/proc/self/cgroup``) and, per
agent, the instance id this server generated (``agent-<hex>``). ``probe`` answers a
``MemoryHost``: the hierarchy (``v2`` or ``v1``), the directory agents' cgroups are made in, or
why agents are unbounded here.

- **cgroup v2** (the unified hierarchy at the root has controllers; Debian 12's default): the
  server's cgroup must have the ``memory`` controller and be writable by the server, which is what
  ``Delegate=yes`` on its unit gives. A cgroup with processes cannot give its children
  controllers, so the server first moves itself into a leaf of its own, ``agentctl``, then writes
  ``+memory`` to the cgroup's ``cgroup.subtree_control``; that leaf is how a later image (after a
  re-exec) knows the set-up is done. A control server the backend runs as its child (survival
  off, passthrough) shares the backend's cgroup; the backend, delegated too, has moved itself into
  its own leaf ``backend`` and given its cgroup the memory controller (``make_room``), so the
  child makes ``agentctl`` beside that leaf and settles there the same way. Each agent's cgroup gets ``memory.max`` and
  ``memory.oom.group = 1`` (the kernel's OOM killer ends the whole agent at once) and
  ``memory.swap.max = 0`` where swap is accounted.
- **cgroup v1** (the memory controller on its own hierarchy, ``<root>/memory``; hybrid hosts): the
  server's memory cgroup is the base (v1 has no rule against processes in inner cgroups); a trial
  cgroup made and removed at probe time tells whether the server may make them. Each agent's
  cgroup gets ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is
  accounted). v1 has no ``memory.oom.group``: the kernel kills one process of the cgroup (the
  largest), and the server ends the rest itself once the kernel tells it the cgroup is out of
  memory (``oom_eventfd``, ``kill_all``), so on both hierarchies an agent over its bound ends whole.

A kill by the bound is read back from the cgroup's own counter (``oom_kills``: ``memory.events``
on v2, ``memory.oom_control`` on v1). ``root`` is a parameter everywhere so tests run on a fake
directory tree.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
from dataclasses import dataclass
from typing import Any, Literal

CGROUP_ROOT = "/sys/fs/cgroup"
SERVER_LEAF = "agentctl"
"""On v2, the leaf of the server's cgroup the server moves itself into."""
BACKEND_LEAF = "backend"
"""On v2, the leaf of the backend's delegated cgroup the backend moves itself into (``make_room``)."""
AGENT_PREFIX = "agent-"
_INSTANCE_ID = re.compile(r"^[0-9a-f]{32}$")  # what instances_api generates: uuid4().hex

Hierarchy = Literal["v2", "v1"]


@dataclass(frozen=True)
class MemoryHost:
    """Where this control server makes its agents' memory cgroups, or why it cannot.

    ``base``: the directory agents' cgroups are made in (None: unbounded); ``own``: the server's
    cgroup as ``/proc/self/cgroup`` names it; ``reason``: why agents are unbounded here."""

    hierarchy: Hierarchy | None
    base: str | None
    own: str | None
    reason: str | None

    @property
    def bounded(self) -> bool:
        return self.base is not None

    def to_wire(self) -> dict[str, Any]:
        return {"bounded": self.bounded, "hierarchy": self.hierarchy, "cgroup": self.base, "reason": self.reason}


def own_cgroups(text: str) -> tuple[str | None, str | None]:
    """From ``/proc/self/cgroup``: the v2 path (``0::``) and the v1 memory controller's path."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _below(root: str, path: str | None) -> str | None:
    """``root`` + ``path`` (a cgroup path as /proc names it), None if it is not a plain absolute
    path (no ``..`` component) that stays inside ``root``."""
    if not path or not path.startswith("/") or "\0" in path:
        return None
    if any(part in ("..", ".") for part in path.split("/")):
        return None
    joined = os.path.normpath(root + path) if path != "/" else os.path.normpath(root)
    if joined != root and not joined.startswith(root.rstrip("/") + "/"):
        return None
    return joined


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    """Write one control file as ``echo TEXT > FILE`` does (a plain file in a test's fake tree)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def _why(exc: OSError) -> str:
    return exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))


def probe(root: str = CGROUP_ROOT, self_cgroup: str | None = None, pid: int | None = None) -> MemoryHost:
    """Where agents' memory cgroups go on this host, setting the server's v2 cgroup up if needed
    (see the module docstring). ``self_cgroup``: the text of ``/proc/self/cgroup`` (read when None)."""
    pid = os.getpid() if pid is None else pid
    if self_cgroup is None:
        try:
            self_cgroup = _read("/proc/self/cgroup")
        except OSError as exc:
            return MemoryHost(None, None, None, f"cannot read /proc/self/cgroup: {_why(exc)}")
    v2_path, v1_path = own_cgroups(self_cgroup)
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return _probe_v2(root, v2_path, pid)
    v1_root = os.path.join(root, "memory")
    if os.path.exists(os.path.join(v1_root, "memory.limit_in_bytes")):
        return _probe_v1(v1_root, v1_path, pid)
    return MemoryHost(None, None, v2_path, f"this host has no memory cgroup controller (no cgroup v2 at {root} with"
                      f" controllers, no cgroup v1 memory hierarchy at {v1_root})")


def host_controller(root: str = CGROUP_ROOT) -> tuple[Hierarchy | None, str]:
    """Where this host's memory controller is, without making anything (``kandev doctor`` before a
    control server answers): the hierarchy and a sentence, or None and why agents would be unbounded."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        if _has_memory(root, "cgroup.controllers"):
            return "v2", (f"cgroup v2 with the memory controller at {root}: each agent gets a memory cgroup below the"
                          " control server's, which needs that cgroup delegated to it (Delegate=yes, as"
                          " kandev-agentctl.service has)")
        return None, f"cgroup v2 at {root} has no memory controller"
    if os.path.exists(os.path.join(root, "memory", "memory.limit_in_bytes")):
        return "v1", (f"the memory controller is on cgroup v1 at {root}/memory: each agent gets a memory cgroup below"
                      " the control server's, which the control server must be allowed to create (root, or a"
                      " cgroup of its own it may write)")
    return None, f"this host has no memory cgroup controller (no cgroup v2 memory controller nor v1 hierarchy at {root})"


def _probe_v2(root: str, path: str | None, pid: int) -> MemoryHost:
    own = _below(root, path)
    if own is None:
        return MemoryHost("v2", None, path, f"the control server's cgroup {path!r} is not below {root}")
    parent = os.path.dirname(own)
    if os.path.basename(own) == SERVER_LEAF and own != root and _has_memory(parent, "cgroup.subtree_control"):
        return MemoryHost("v2", parent, path, None)  # set up by an earlier image of this server (before a re-exec)
    where = f"the control server's cgroup {path}"
    if os.path.basename(own) == BACKEND_LEAF and _has_memory(parent, "cgroup.subtree_control"):
        # the backend's child (survival off, passthrough): agents' cgroups beside the backend's leaf
        return _settle(os.path.join(parent, SERVER_LEAF), path, pid, where)
    if not _has_memory(own, "cgroup.controllers"):
        return MemoryHost("v2", None, path, f"the memory controller is not available in {where} (its unit needs"
                          " Delegate=yes)")
    problem = _not_ours(own, pid, where)
    if problem:
        return MemoryHost("v2", None, path, problem + ": run the control server in a unit with Delegate=yes")
    return _settle(own, path, pid, where)


def _not_ours(cgroup: str, pid: int, where: str) -> str | None:
    """Why ``cgroup`` cannot be given children with controllers by us: not writable, or other processes."""
    if not (os.access(cgroup, os.W_OK) and os.access(os.path.join(cgroup, "cgroup.subtree_control"), os.W_OK)):
        return f"{where} is not delegated to it (not writable by uid {os.geteuid()})"
    try:
        others = [p for p in _read(os.path.join(cgroup, "cgroup.procs")).split() if p != str(pid)]
    except OSError as exc:
        return f"cannot read {where}'s processes: {_why(exc)}"
    return f"{where} holds other processes too ({len(others)})" if others else None


def _settle(base: str, path: str | None, pid: int, where: str) -> MemoryHost:
    """Make ``base`` the parent of agents' cgroups: the server moves into ``base/agentctl``, then
    ``base`` gives its children the memory controller."""
    leaf = os.path.join(base, SERVER_LEAF)
    try:
        for directory in (base, leaf):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o755)
        _write(os.path.join(leaf, "cgroup.procs"), str(pid))
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory")
    except OSError as exc:
        return MemoryHost("v2", None, path, f"cannot enable the memory controller below {where}: {_why(exc)}")
    return MemoryHost("v2", base, path, None)


def make_room(root: str = CGROUP_ROOT, self_cgroup: str | None = None, pid: int | None = None) -> str | None:
    """The backend's part, on cgroup v2 in a delegated cgroup of its own (its unit's ``Delegate=yes``):
    it moves itself into ``<cgroup>/backend`` and gives its cgroup the memory controller, so that a
    control server it runs as its child (survival off, passthrough) can make its agents' cgroups in
    ``<cgroup>/agentctl``, beside it. Returns why it did nothing (None: done); never raises."""
    pid = os.getpid() if pid is None else pid
    try:
        text = _read("/proc/self/cgroup") if self_cgroup is None else self_cgroup
    except OSError as exc:
        return f"cannot read /proc/self/cgroup: {_why(exc)}"
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        return "not cgroup v2"
    path = own_cgroups(text)[0]
    own = _below(root, path)
    if own is None or own == root or os.path.basename(own) == BACKEND_LEAF:
        return None if own is not None and own != root else f"the backend's cgroup {path!r} is not one of its own"
    where = f"the backend's cgroup {path}"
    if not _has_memory(own, "cgroup.controllers"):
        return f"the memory controller is not available in {where}"
    problem = _not_ours(own, pid, where)
    if problem:
        return problem
    leaf = os.path.join(own, BACKEND_LEAF)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(leaf, 0o755)
        _write(os.path.join(leaf, "cgroup.procs"), str(pid))
        _write(os.path.join(own, "cgroup.subtree_control"), "+memory")
    except OSError as exc:
        return f"cannot enable the memory controller below {where}: {_why(exc)}"
    return None


def _has_memory(cgroup: str, name: str) -> bool:
    try:
        return "memory" in _read(os.path.join(cgroup, name)).split()
    except OSError:
        return False


def _probe_v1(v1_root: str, path: str | None, pid: int) -> MemoryHost:
    own = _below(v1_root, path)
    if own is None:
        return MemoryHost("v1", None, path, f"the control server's memory cgroup {path!r} is not below {v1_root}")
    trial = os.path.join(own, f"kandev-probe-{pid}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(trial, 0o755)
        os.rmdir(trial)
    except OSError as exc:
        return MemoryHost("v1", None, path, f"cannot create a memory cgroup below the control server's {path}"
                          f" (cgroup v1): {_why(exc)}")
    return MemoryHost("v1", own, path, None)


# ---------------------------------------------------------------- one agent's cgroup


@dataclass(frozen=True)
class AgentCgroup:
    """One agent's memory cgroup: its directory, hierarchy and bound in bytes."""

    hierarchy: Hierarchy
    path: str
    limit: int


def agent_path(host: MemoryHost, instance_id: str) -> str:
    """The cgroup directory of instance ``instance_id`` (ValueError for an id this server would
    never generate)."""
    if host.base is None:
        raise ValueError("agents are unbounded here")
    if not _INSTANCE_ID.match(instance_id):
        raise ValueError(f"{instance_id!r:.80} is not an instance id")
    return os.path.join(host.base, AGENT_PREFIX + instance_id)


def create(host: MemoryHost, instance_id: str, limit: int) -> AgentCgroup:
    """Make the agent's cgroup with its bound (OSError if the kernel refuses; nothing is left)."""
    path = agent_path(host, instance_id)
    assert host.hierarchy is not None
    os.mkdir(path, 0o755)
    try:
        if host.hierarchy == "v2":
            _write(os.path.join(path, "memory.max"), str(limit))
            _write(os.path.join(path, "memory.oom.group"), "1")
            _optional(os.path.join(path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
            _optional(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit))
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return AgentCgroup(host.hierarchy, path, limit)


def _optional(path: str, text: str) -> None:
    """Write a file that exists only where the kernel accounts swap."""
    if os.path.exists(path):
        with contextlib.suppress(OSError):
            _write(path, text)


def open_procs(cg: AgentCgroup) -> int:
    """A descriptor of the cgroup's ``cgroup.procs``: the spawned child writes its own pid to it
    before it executes the agent, so everything the agent starts is inside from the start."""
    return os.open(os.path.join(cg.path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)


def oom_kills(cg: AgentCgroup) -> int:
    """How many processes the kernel's OOM killer ended in this cgroup (0 if it cannot be read)."""
    name = "memory.events" if cg.hierarchy == "v2" else "memory.oom_control"
    try:
        text = _read(os.path.join(cg.path, name))
    except OSError:
        return 0
    counts = dict(line.split(None, 1) for line in text.splitlines() if " " in line)
    kills = [int(counts[key]) for key in ("oom_kill", "oom_group_kill") if counts.get(key, "").strip().isdigit()]
    return max(kills, default=0)


def peak(cg: AgentCgroup) -> int | None:
    """The most memory the cgroup used (None where the kernel does not say)."""
    name = "memory.peak" if cg.hierarchy == "v2" else "memory.max_usage_in_bytes"
    try:
        return int(_read(os.path.join(cg.path, name)).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def oom_eventfd(cg: AgentCgroup) -> int | None:
    """v1: an eventfd the kernel signals at each OOM in the cgroup (``cgroup.event_control``);
    None on v2 (``memory.oom.group`` ends the whole cgroup) or if it cannot be registered."""
    if cg.hierarchy != "v1":
        return None
    efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    try:
        ofd = os.open(os.path.join(cg.path, "memory.oom_control"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _write(os.path.join(cg.path, "cgroup.event_control"), f"{efd} {ofd}")
        finally:
            os.close(ofd)
    except OSError:
        os.close(efd)
        return None
    return efd


def members(cg: AgentCgroup) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(cg.path, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def kill_all(cg: AgentCgroup) -> int:
    """SIGKILL every process in the cgroup (v2: ``cgroup.kill``); each pid is signalled through a
    pidfd opened while it is still a member, so a pid reused outside the cgroup is never hit.
    Returns how many were signalled."""
    if cg.hierarchy == "v2" and os.path.exists(os.path.join(cg.path, "cgroup.kill")):
        with contextlib.suppress(OSError):
            _write(os.path.join(cg.path, "cgroup.kill"), "1")
            return len(members(cg))
    sent = 0
    for pid in members(cg):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in members(cg):  # still ours now that the pidfd pins it
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                sent += 1
        except OSError:
            pass
        finally:
            os.close(pidfd)
    return sent


def remove(cg: AgentCgroup) -> bool:
    """Remove the cgroup once it is empty; True if it is gone."""
    try:
        os.rmdir(cg.path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def leftovers(host: MemoryHost) -> list[str]:
    """Agents' cgroups below ``host.base`` (of instances a previous lifetime ran)."""
    if host.base is None:
        return []
    try:
        names = os.listdir(host.base)
    except OSError:
        return []
    return sorted(os.path.join(host.base, n) for n in names
                  if n.startswith(AGENT_PREFIX) and _INSTANCE_ID.match(n[len(AGENT_PREFIX):]))
