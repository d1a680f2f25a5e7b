"""The agents' system-call filter: a seccomp program bubblewrap loads just before it runs the agent.

A sandboxed agent still has the whole kernel in reach, and most kernel exploits start with a few
system calls no coding agent needs: a user namespace of its own (``unshare -Ur`` makes the agent
root there, the first step of most namespace exploits), io_uring, the kernel keyring, ``bpf``. The
filter, modelled on Docker's default profile and Flatpak's, refuses those and lets everything else
through (a block list, as Flatpak's, so that Node, npm, git, Python and the real agents run as
they do elsewhere):

- ``EPERM``: new namespaces (``unshare`` and ``clone`` with any ``CLONE_NEW*`` flag; ``setns``),
  io_uring, the keyring (``add_key``, ``keyctl``, ``request_key``), ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``kexec_load``/``kexec_file_load``, module loading, every way to mount
  (``mount``, ``umount2``, ``pivot_root``, ``chroot`` and the new mount API: ``fsopen``,
  ``open_tree``, ``move_mount``...), and a few more of Docker's and Flatpak's (``syslog``,
  ``uselib``, ``acct``, ``quotactl``, ``swapon``, ``reboot``, ``open_by_handle_at``...), plus the
  ``ioctl``s that push input into a terminal (``TIOCSTI``, ``TIOCLINUX``);
- ``ENOSYS``: ``clone3``, whose flags sit in memory a filter cannot read; glibc, Node and Go then
  fall back to ``clone``, whose flags the filter checks;
- ``EAFNOSUPPORT``: sockets of families other than Unix, IPv4, IPv6 and netlink (Flatpak's list:
  the rarely used protocol families are where many kernel bugs were).

The same rules hold for each ABI the kernel runs on this machine (on x86-64 also the 32-bit x86 and
x32 ones, as Docker does; a system call of any other architecture kills the thread making it:
libseccomp's default, set without asking the kernel, which a unit's own filter may not let it ask).
On 32-bit x86, socket calls made through ``socketcall`` cannot be inspected and pass (as in Flatpak).

The program is built with libseccomp's own Python bindings (Debian ``python3-seccomp``; the
library Docker, systemd and Flatpak build their filters with), once per process from the rules
above and nothing else (never from anything an agent can write), and handed to each bwrap as a
sealed memory file (``program_fd``). ``describe`` names it for ``kandev status`` and ``kandev
doctor``: the rules' version and a digest of the program. bwrap loads it in the sandbox just
before it executes the agent's command, after its own set-up (which needs ``mount``,
``pivot_root`` and ``unshare``); every process the agent starts inherits it, so it holds for an
agent that survives a backend restart or a reload of the control server.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import platform
import socket
import termios
from dataclasses import dataclass
from typing import Any

from daemon.host.memfd import sealed_memfd

RULES_VERSION = 1
"""Bumped whenever the rules change (``kandev status`` shows it with the program's digest)."""
MEMFD_NAME = "kandev-seccomp"
HINT = "apt-get install python3-seccomp (libseccomp's Python bindings)"

REFUSED = (
    # namespaces (unshare and clone: below, by their flags)
    "setns",
    # io_uring: its own path into the kernel, outside what a filter sees
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # the kernel keyring (not namespaced)
    "add_key", "keyctl", "request_key",
    # kernel programs, profiling, page-fault handling in user space (exploit primitives)
    "bpf", "perf_event_open", "userfaultfd",
    # the kernel itself and its modules
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    # mounting, old and new API
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr",
    # Docker's and Flatpak's other refusals no coding agent needs
    "syslog", "uselib", "acct", "quotactl", "quotactl_fd", "swapon", "swapoff", "reboot",
    "open_by_handle_at", "lookup_dcookie", "nfsservctl", "vm86", "vm86old", "fanotify_init",
)
"""System calls refused with ``EPERM`` whatever their arguments (one unknown to this libseccomp or
architecture is skipped)."""

CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
CLONE_NEWTIME = 0x00000080
"""``unshare`` only: in ``clone``'s flags the low byte is the exit signal."""

TERMINAL_INPUT_IOCTLS = (termios.TIOCSTI, 0x541C)  # TIOCSTI, TIOCLINUX
SOCKET_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK)

COMPAT_ARCHES = {"x86_64": ("X86", "X32"), "aarch64": ("ARM",)}
"""The other ABIs the kernel of each machine runs, given the same rules (Docker's ``archMap``)."""


class SeccompUnavailable(Exception):
    """The filter cannot be built here (the bindings are missing, or libseccomp refused a rule)."""


@dataclass(frozen=True)
class AgentFilter:
    """The compiled program (classic BPF, as ``prctl(PR_SET_SECCOMP)`` takes it) and its name."""

    program: bytes
    version: str

    @property
    def instructions(self) -> int:
        return len(self.program) // 8


def _bindings() -> Any:
    try:
        import seccomp  # Debian python3-seccomp: libseccomp's own bindings
    except ImportError as exc:
        raise SeccompUnavailable(f"libseccomp's Python bindings cannot be imported ({exc}); {HINT}") from None
    return seccomp


def _add(flt: Any, action: Any, name: str, *args: Any) -> None:
    try:
        flt.add_rule(action, name, *args)
    except ValueError:
        pass  # not a system call of this libseccomp's tables (or of any of the filter's architectures)


def _masked(sc: Any, flag: int) -> Any:
    return sc.Arg(0, sc.MASKED_EQ, flag, flag)


def build() -> AgentFilter:
    """Compile the filter of the module docstring (pure: no file or agent input; a few ms)."""
    sc = _bindings()
    try:
        flt = sc.SyscallFilter(sc.ALLOW)
        for arch in COMPAT_ARCHES.get(platform.machine(), ()):
            flt.add_arch(getattr(sc.Arch, arch))
        refuse = sc.ERRNO(errno.EPERM)
        for name in REFUSED:
            _add(flt, refuse, name)
        _add(flt, sc.ERRNO(errno.ENOSYS), "clone3")
        for flag in CLONE_NEW.values():
            _add(flt, refuse, "clone", _masked(sc, flag))
        for flag in (*CLONE_NEW.values(), CLONE_NEWTIME):
            _add(flt, refuse, "unshare", _masked(sc, flag))
        for request in TERMINAL_INPUT_IOCTLS:  # the request is an int: compare its low 32 bits only
            _add(flt, refuse, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
        no_family = sc.ERRNO(errno.EAFNOSUPPORT)
        allowed = sorted(SOCKET_FAMILIES)
        for family in range(allowed[-1]):
            if family not in allowed:
                _add(flt, no_family, "socket", sc.Arg(0, sc.EQ, family))
        _add(flt, no_family, "socket", sc.Arg(0, sc.GT, allowed[-1]))
        with os.fdopen(os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC), "w+b") as out:
            flt.export_bpf(out)
            out.seek(0)
            program = out.read()
    except (OSError, RuntimeError, ValueError) as exc:
        raise SeccompUnavailable(f"libseccomp could not build the agents' system-call filter: {exc}") from None
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a program of {len(program)} bytes, not whole instructions")
    digest = hashlib.sha256(program).hexdigest()[:12]
    return AgentFilter(program, f"kandev-seccomp/{RULES_VERSION} sha256:{digest}")


@functools.cache
def agent_filter() -> AgentFilter:
    """The filter of this process, built on first use (raises ``SeccompUnavailable``; not cached then)."""
    return build()


def describe() -> str:
    """What ``kandev status`` shows: the rules' version and the program's digest."""
    return agent_filter().version


def program_fd() -> int:
    """A new descriptor holding the program, at offset 0, sealed against any change: bwrap's
    ``--seccomp FD`` reads it to the end and closes it. The caller passes it to bwrap and closes
    its own copy."""
    return sealed_memfd(MEMFD_NAME, agent_filter().program)
