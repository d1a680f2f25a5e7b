"""The sandbox probe: can agents be sandboxed here, with this process's rights?

``probe`` makes a real sandbox of the kind every agent gets (the flags, a /proc mount, the SIGTERM
reset, the system-call filter, a network namespace of its own) and runs ``true`` in it; what it
learns is a ``SandboxSupport``: available or not and why, bubblewrap's version, the filter's, and
whether the namespaces an older unit may refuse (network, IPC) can be made. The control server
probes at start (``daemon.agentctl.sandbox_host``); ``kandev doctor`` probes with its own rights when
no backend answers.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping

from daemon.agentctl.sandbox import seccomp_filter
from daemon.agentctl.sandbox.bubblewrap import (
    BWRAP,
    PROBE_TIMEOUT_S,
    SandboxSupport,
    SandboxView,
    build_argv,
    find_bwrap,
    ignore_sigterm,
    system_binds,
    system_links,
)
from daemon.agentctl.sandbox.network import SandboxNet
from daemon.agentctl.sandbox.userns import make_userns
from daemon.host.agent_user import AgentUser, AgentUserMissing, agent_user


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


def probe(env: Mapping[str, str] | None = None) -> SandboxSupport:
    """Make a real sandbox with this process's rights (the flags agents get, a /proc mount, the
    SIGTERM reset) and run ``true`` in it. Blocking (up to ``PROBE_TIMEOUT_S``): call it off the
    event loop."""
    bwrap = find_bwrap(env)
    if bwrap is None:
        return SandboxSupport(False, f"{BWRAP} (bubblewrap) is not on the PATH"
                              f" ({(os.environ if env is None else env).get('PATH', os.defpath)})")
    version = None
    try:
        done = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
        version = _first_line(done.stdout).removeprefix("bubblewrap ").strip() or None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return SandboxSupport(False, f"{bwrap} --version failed: {exc}", bwrap)
    env_tool = shutil.which("env", path="/usr/bin:/bin") or "/usr/bin/env"
    try:
        seccomp = seccomp_filter.describe()
    except seccomp_filter.SeccompUnavailable as exc:
        return SandboxSupport(False, str(exc), bwrap, version)
    try:
        user = agent_user()
    except AgentUserMissing as exc:
        return SandboxSupport(False, str(exc), bwrap, version)
    view = SandboxView(bwrap=bwrap, uid=user.uid, gid=user.gid, binds=system_binds(), cwd="/", env_tool=env_tool,
                       links=system_links(), own_userns=user.dedicated, net=SandboxNet())
    support = dataclasses.replace(_trial(view, user, bwrap, version), seccomp=seccomp)
    if support.available:
        return support
    # A server reloaded in place keeps the namespace restrictions its unit had when it started: an
    # older unit may admit no IPC namespace, or no network namespace. Sandboxed agents without an IPC
    # namespace of their own beat no agents at all; the reason says so until the server is restarted
    # under the current unit.
    without_ipc = _trial(dataclasses.replace(view, own_ipc=False), user, bwrap, version)
    if without_ipc.available:
        return dataclasses.replace(
            without_ipc, ipc_namespace=False, seccomp=seccomp,
            reason="agents get no IPC namespace of their own (SysV IPC is shared between sandboxes): this process"
                   " may not create one, e.g. a control server reloaded in place under an older unit without"
                   " RestrictNamespaces=ipc; once its agents are done, `systemctl stop kandev-agentctl` and the backend starts it again under the current unit")
    # An agent without a network namespace of its own would share the host's network: never. Say
    # why no agent can start, when that is the one thing missing (with or without an IPC namespace).
    no_net = dataclasses.replace(view, net=None)
    if (_trial(no_net, user, bwrap, version).available
            or _trial(dataclasses.replace(no_net, own_ipc=False), user, bwrap, version).available):
        return dataclasses.replace(
            support, network_namespace=False,
            reason=f"agents cannot get a network namespace of their own ({support.reason}): this process may not"
                   " create one, e.g. a unit whose RestrictNamespaces= has no net (a control server reloaded in"
                   " place under an older unit: once its agents are done, `systemctl stop kandev-agentctl` and the backend starts it again under the current unit)")
    return support


def _trial(view: SandboxView, user: AgentUser, bwrap: str, version: str | None) -> SandboxSupport:
    """Run ``true`` in a sandbox of ``view``."""
    try:
        userns = make_userns(user) if user.dedicated else None
    except OSError as exc:
        return SandboxSupport(False, f"cannot make a user namespace for {user.name}: {exc}", bwrap, version)
    fds = (*(userns or ()), seccomp_filter.program_fd())
    argv = build_argv(view, ["true"], userns, seccomp=fds[-1])
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=ignore_sigterm, pass_fds=fds)
    except OSError as exc:
        return SandboxSupport(False, f"cannot run {bwrap}: {exc.strerror or exc}", bwrap, version)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        _, err = proc.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # A system-call filter that denies what bwrap needs can leave it waiting for ever.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return SandboxSupport(False, f"{bwrap} did not finish a trial sandbox within {PROBE_TIMEOUT_S:g} s"
                              " (a system-call filter denying capset or mount?)", bwrap, version)
    if proc.returncode != 0:
        why = _first_line(err.decode(errors="replace")) or f"exit code {proc.returncode}"
        return SandboxSupport(False, f"{bwrap} cannot make a sandbox here: {why}"
                              " (user namespaces forbidden, or a unit's RestrictNamespaces=/SystemCallFilter=?)",
                              bwrap, version)
    return SandboxSupport(True, None, bwrap, version)
