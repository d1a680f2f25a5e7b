"""The user namespaces of an agent whose control server runs as root (``make_userns``).

A server running as root cannot let bwrap make the agent's user namespace itself (bwrap would map
the agent to host uid 0), so it makes two: one for bwrap's set-up, which maps root so that bwrap
can mount every path root reaches, and one nested inside it that maps only the agent's uid and gid,
which bwrap enters once its mounts are done. Each namespace is made by a short-lived holder process
(``/bin/cat``) and kept as a descriptor bwrap inherits (``--userns``/``--userns2``). Blocking: call
it off the event loop. ``daemon.agentctl.sandbox.bubblewrap`` builds the bwrap command line around them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from typing import Any

from daemon.host.agent_user import AgentUser

CLONE_NEWUSER = 0x10000000
HOLDER_TIMEOUT_S = 10.0


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


_LIBC = ctypes.CDLL(None, use_errno=True)  # resolved in the parent: a forked child only calls it


def _enter_new_userns() -> None:
    """``preexec_fn`` of ``make_userns``'s first holder process."""
    if _LIBC.unshare(CLONE_NEWUSER) != 0:
        os._exit(126)


def _enter_nested_userns(parent_fd: int) -> Any:
    """``preexec_fn`` of the second holder: join the set-up namespace, then make one inside it."""

    def enter() -> None:
        if _LIBC.setns(parent_fd, CLONE_NEWUSER) != 0 or _LIBC.unshare(CLONE_NEWUSER) != 0:
            os._exit(126)

    return enter


def _join_userns(fd: int) -> Any:
    """``preexec_fn``: enter the user namespace at ``fd`` (we own it: every capability in it)."""

    def enter() -> None:
        if _LIBC.setns(fd, CLONE_NEWUSER) != 0:
            os._exit(126)

    return enter


def _holder(preexec: Any, maps: dict[str, str], *, writer_ns: int | None = None) -> int:
    """A process in a new user namespace (``preexec`` makes it), whose uid and gid maps are written
    by us, or for a nested namespace from inside its parent ``writer_ns`` (the kernel takes a map
    only from the namespace itself or its parent); the namespace as a descriptor (it lives on
    with the descriptor once the holder has ended)."""
    extra = () if writer_ns is None else (writer_ns,)
    holder = subprocess.Popen(["/bin/cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, preexec_fn=preexec, close_fds=True, pass_fds=extra)
    try:
        proc = f"/proc/{holder.pid}"
        if os.stat(f"{proc}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino:
            raise OSError("the holder process did not get a new user namespace")
        if writer_ns is None:
            for name in ("uid_map", "gid_map"):
                with open(f"{proc}/{name}", "w", encoding="ascii") as fh:
                    fh.write(maps[name])
        else:
            done = subprocess.run(
                ["/bin/sh", "-c", 'printf "$1" > "/proc/$0/uid_map" && printf "$2" > "/proc/$0/gid_map"',
                 str(holder.pid), maps["uid_map"], maps["gid_map"]],
                preexec_fn=_join_userns(writer_ns), pass_fds=extra, capture_output=True, timeout=HOLDER_TIMEOUT_S,
                check=False)
            if done.returncode != 0:
                raise OSError(f"cannot map the agent's namespace: {_first_line(done.stderr.decode(errors='replace'))}")
        return os.open(f"{proc}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        try:
            holder.wait(HOLDER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def make_userns(user: AgentUser) -> tuple[int, int]:
    """The two user namespaces of one agent of a server running as root, as descriptors for bwrap's
    ``--userns`` and ``--userns2``. The first, for bwrap's set-up only, maps uid and gid 0 to host
    root (bwrap mounts as root of it, so it reaches every path root can) and the agent's uid and
    gid to themselves. The second, made inside the first, maps the agent's uid and gid and nothing
    else: bwrap enters it once the mounts are done, so the agent's namespace has no root at all.
    Blocking: call it off the event loop."""
    setup = _holder(_enter_new_userns, {"uid_map": f"0 0 1\n{user.uid} {user.uid} 1\n",
                                        "gid_map": f"0 0 1\n{user.gid} {user.gid} 1\n"})
    try:
        agent = _holder(_enter_nested_userns(setup), {"uid_map": f"{user.uid} {user.uid} 1\n",
                                                      "gid_map": f"{user.gid} {user.gid} 1\n"}, writer_ns=setup)
    except BaseException:
        os.close(setup)
        raise
    return setup, agent
