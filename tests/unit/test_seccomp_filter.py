"""The agents' system-call filter (daemon.agentctl.sandbox.seccomp_filter), loaded into a child process.

Issue 44 item 6 and Issue 44 scenario E at the level of the program itself: a process that loaded it (as
bwrap does, with no-new-privileges) gets EPERM for a new user namespace, io_uring, the keyring and
the rest, ENOSYS for clone3, EAFNOSUPPORT for a rare socket family, also through the x32 ABI, while
threads, subprocesses and ordinary sockets work. The sandbox tests (tests/integration/test_seccomp.py)
check the same from inside real agents.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys

import pytest

from daemon.agentctl.sandbox import seccomp_filter
from daemon.agentctl.sandbox.bubblewrap import Bind, BindMode, SandboxView, build_argv

X86_64 = platform.machine() == "x86_64"
X32_BIT = 0x40000000

# Runs in the child: load the program read from the descriptor argv[2] names, then try each call; prints
# name -> errno (0: it worked). The test runs as root: every call is made so that, should the filter
# let it through, it changes nothing outside the child (a bad argument, a path that does not exist, a
# namespace of the child's own), and the kernel's answer then differs from the filter's.
CHILD = r"""
import ctypes, errno, json, os, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
program = os.read(int(sys.argv[2]), 1 << 20)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
prog = Prog(len(program) // 8, program)
assert libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return 0 if r >= 0 else ctypes.get_errno()
nrs = json.loads(sys.argv[1])
buf = ctypes.create_string_buffer(256)
out = {
    "unshare_user": call(nrs["unshare"], 0x10000000),
    "unshare_net": call(nrs["unshare"], 0x40000000),
    "unshare_files": call(nrs["unshare"], 0x400),  # CLONE_FILES: no namespace, allowed
    "clone_newuser": call(nrs["clone"], 0x10000000 | 0x200, 0, 0, 0, 0),  # with CLONE_FS: EINVAL unfiltered
    "clone3": call(nrs["clone3"], buf, 0),  # a size too small: EINVAL unfiltered
    "io_uring_setup": call(nrs["io_uring_setup"], 8, buf),
    "add_key": call(nrs["add_key"], b"kandev-no-such-key-type", b"k", b"v", 1, -3),
    "keyctl": call(nrs["keyctl"], 0, -3, 0),
    "bpf": call(nrs["bpf"], 0, buf, 64),
    "setns": call(nrs["setns"], 0, 0),
    "mount": call(nrs["mount"], b"none", b"/nonexistent/kandev-seccomp-test", b"tmpfs", 0, 0),
}
if "x32_add_key" in nrs:
    out["x32_add_key"] = call(nrs["x32_add_key"], b"kandev-no-such-key-type", b"k", b"v", 1, -3)
try:
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
    out["vsock"] = 0
except OSError as e:
    out["vsock"] = e.errno
socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
t = threading.Thread(target=lambda: None); t.start(); t.join()
out["subprocess"] = subprocess.run(["true"]).returncode
out["seccomp_mode"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
print(json.dumps(out))
"""

NUMBERS = {"unshare": 272, "clone": 56, "clone3": 435, "io_uring_setup": 425, "add_key": 248, "keyctl": 250,
           "bpf": 321, "setns": 308, "mount": 165, "x32_add_key": X32_BIT | 248}


@pytest.mark.skipif(not X86_64, reason="system call numbers of x86-64")
def test_scenario_e_the_program_refuses_what_agents_must_not_do_and_keeps_the_rest() -> None:
    """Issue 44 scenario E (the program alone): EPERM for namespaces, io_uring, keyring, bpf, setns,
    mount, also for add_key called through the x32 ABI; ENOSYS for clone3; EAFNOSUPPORT for
    AF_VSOCK; threads, a subprocess, IPv4 and Unix sockets and a namespace-free unshare work."""
    fd = seccomp_filter.program_fd()
    try:
        done = subprocess.run([sys.executable, "-I", "-c", CHILD, json.dumps(NUMBERS), str(fd)], pass_fds=(fd,),
                              capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    refused = {name: got[name] for name in ("unshare_user", "unshare_net", "clone_newuser", "io_uring_setup",
                                            "add_key", "keyctl", "bpf", "setns", "mount", "x32_add_key")}
    assert refused == dict.fromkeys(refused, errno.EPERM), got
    assert got["clone3"] == errno.ENOSYS and got["vsock"] == errno.EAFNOSUPPORT, got
    assert got["unshare_files"] == 0 and got["subprocess"] == 0 and got["seccomp_mode"] == "2", got


def test_the_program_is_built_once_and_named_by_its_rules_and_digest() -> None:
    """``kandev status`` shows the filter's version: the rules' version and the program's digest."""
    first, again = seccomp_filter.agent_filter(), seccomp_filter.agent_filter()
    assert first is again and first.instructions > 50 and len(first.program) % 8 == 0
    assert seccomp_filter.describe() == first.version
    assert first.version.startswith(f"kandev-seccomp/{seccomp_filter.RULES_VERSION} sha256:")
    assert seccomp_filter.build().program == first.program  # the same rules give the same program


def test_each_descriptor_holds_the_whole_program_from_the_start_and_is_sealed() -> None:
    fd = seccomp_filter.program_fd()
    try:
        assert os.read(fd, 1 << 20) == seccomp_filter.agent_filter().program
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0" * 8, 0)
    finally:
        os.close(fd)


def test_bwrap_gets_the_filter_descriptor_before_its_mounts() -> None:
    view = SandboxView(bwrap="/usr/bin/bwrap", uid=1000, gid=1000, binds=(Bind("/usr", BindMode.READONLY),),
                       cwd="/ws")
    argv = build_argv(view, ["agent"], seccomp=7)
    assert argv[argv.index("--seccomp") + 1] == "7" and argv.index("--seccomp") < argv.index("--")
    assert "--seccomp" not in build_argv(view, ["agent"])


def test_a_host_without_the_bindings_gets_a_reason_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 item 7: where the filter cannot be built, the sandbox is unavailable and says why."""
    monkeypatch.setitem(sys.modules, "seccomp", None)  # import seccomp then raises ImportError
    with pytest.raises(seccomp_filter.SeccompUnavailable, match="python3-seccomp"):
        seccomp_filter.build()


UNDER_A_UNIT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
program = os.read(int(sys.argv[1]), 1 << 20)
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
assert libc.prctl(38, 1, 0, 0, 0) == 0
assert libc.prctl(22, 2, ctypes.byref(Prog(len(program) // 8, program)), 0, 0) == 0
from daemon.agentctl.sandbox import seccomp_filter
print(seccomp_filter.build().version)
"""


def test_the_program_builds_where_a_units_own_filter_refuses_the_seccomp_system_call() -> None:
    """Issue 44 item 6 under the units: their ``SystemCallFilter=`` refuses ``seccomp(2)``, with
    which libseccomp asks the kernel what it supports; the program is still built (the same one),
    needing no answer (a bad-architecture action of KILL_PROCESS once made it fail there)."""
    import seccomp

    unit = seccomp.SyscallFilter(seccomp.ALLOW)
    unit.add_rule(seccomp.ERRNO(errno.EPERM), "seccomp")
    read, write = os.pipe()
    with os.fdopen(write, "wb") as out:
        unit.export_bpf(out)
    try:
        done = subprocess.run([sys.executable, "-c", UNDER_A_UNIT, str(read)], pass_fds=(read,),
                              capture_output=True, text=True, timeout=60)
    finally:
        os.close(read)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == seccomp_filter.describe()
