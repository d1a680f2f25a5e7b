"""``kandev doctor``'s checks of the agent sandbox and of agents' network (Issue 10, Issue 44).

``sandbox``: whether agents are sandboxed (``agents.sandbox``) and, if they cannot be, why: as the
running control server reports (``status``'s ``sandbox``), else as a probe by this command says.
``network``: the configured ``network.mode`` and whether each agent can get a network namespace of
its own (without one no agent starts), from the same source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.config.platform import Check

SANDBOX_HINT = ("apt-get install bubblewrap python3-seccomp; allow unprivileged user namespaces (sysctl"
                " user.max_user_namespaces > 0); under systemd keep the units' RestrictNamespaces=user mnt pid"
                " and SystemCallFilter=@mount; or set agents.sandbox = \"off\" to run agents unsandboxed")
NETWORK_HINT = ("under systemd keep net in the units' RestrictNamespaces= (and AF_NETLINK in"
                " RestrictAddressFamilies=, for the namespace's loopback); after an upgrade, `systemctl stop kandev-agentctl` once its agents are done (the backend starts it again)")


def _check(name: str, ok: bool, detail: str, hint: str | None = None) -> Check:
    return Check(name, ok, detail, None if ok else hint)


def network_check(mode: str, own_namespace: Any, where: str, reason: str | None) -> Check:
    """The network mode and whether each agent can get a network namespace of its own."""
    if own_namespace is None:
        return _check("network", True, f"network.mode = {mode!r}; whether agents get a network namespace of their"
                      " own is not known: no sandbox can be made here (see sandbox)")
    if own_namespace:
        return _check("network", True, f"network.mode = {mode!r}; every agent runs in a network namespace of its own"
                      f" and reaches out only through its egress proxy ({where})")
    return _check("network", False, f"network.mode = {mode!r}; agents cannot get a network namespace of their own"
                  f" ({where}): {reason}", NETWORK_HINT)


def sandbox_checks(policy: str, mode: str, reported: Any, probe: Callable[[], Any]) -> list[Check]:
    """The ``sandbox`` and ``network`` lines; ``reported``: the running server's answer (status's
    ``sandbox``), else ``probe`` makes a trial sandbox with this command's rights."""
    if policy == "off":
        return [_check("sandbox", True, 'agents.sandbox = "off": agents run WITHOUT a sandbox; they can reach'
                       " everything the service user can, its network included (a warning is logged at every"
                       " agent start)")]
    if isinstance(reported, dict) and reported.get("available") is not None:
        where = "as the running control server reports"
        sandbox = (_check("sandbox", True, f"agents are sandboxed (bubblewrap {reported.get('version') or '?'},"
                          f" system-call filter {reported.get('seccomp') or '?'}), {where}") if reported.get("sandboxed") else
                   _check("sandbox", False, f"agents cannot be sandboxed: {reported.get('reason')}", SANDBOX_HINT))
        return [sandbox, network_check(mode, reported.get("network_namespace"), where, reported.get("reason"))]
    support = probe()
    where = "probed by this command, not inside the units (no backend answered)"
    if support.available:
        sandbox = _check("sandbox", True, f"agents can be sandboxed (bubblewrap {support.version or '?'} at"
                         f" {support.bwrap}, system-call filter {support.seccomp or '?'}; {where})")
    else:
        sandbox = _check("sandbox", False, f"agents cannot be sandboxed: {support.reason} ({where}); agents.sandbox ="
                         ' "required": every agent start fails with sandbox_unavailable', SANDBOX_HINT)
    own = getattr(support, "network_namespace", True)  # (a probe of a release before Issue 44 has none)
    return [sandbox, network_check(mode, own if support.available or not own else None, where, support.reason)]
