"""The agent's network inside its sandbox: a namespace of its own, and the one way out.

Every sandboxed agent gets ``--unshare-net``: a network namespace whose only interface is its own
loopback (bwrap brings it up). Nothing of the host's network is there: not the host's loopback
services, not the host's abstract Unix sockets (they belong to a network namespace), not another
agent's. With a network mode other than ``"none"`` the agent's command is started through the relay
(``daemon.agentctl.sandbox.relay``): it listens on ``127.0.0.1:PROXY_PORT`` in the agent's
namespace and hands each connection to the session's egress proxy in the control server
(``daemon.agentctl.egress``) over the Unix socket bound into the sandbox. The agent's environment
names that port in every proxy variable its tools read (``proxy_env``); ``NO_PROXY`` is empty.
With ``"none"`` there is no relay, no socket and no proxy variable: the agent has no network.

``SandboxNet`` is what ``daemon.agentctl.sandbox.bubblewrap.build_argv`` needs: ``bwrap_args``
(the namespace flag) and ``command_prefix`` (the relay before the agent's command).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")
NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy")
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py")


@dataclass(frozen=True)
class SandboxNet:
    """The network of one sandbox: its own namespace always; ``proxy_socket``: the session's egress
    proxy socket the relay hands connections to (None: mode ``"none"``, no way out)."""

    proxy_socket: str | None = None


def bwrap_args(net: SandboxNet | None) -> list[str]:
    """bwrap's flags for the agent's network (a view without ``net``: the host's, for the probe's
    comparison only)."""
    return ["--unshare-net"] if net is not None else []


def command_prefix(net: SandboxNet | None) -> list[str]:
    """What runs before the agent's command inside the sandbox: the relay, when there is a proxy."""
    if net is None or net.proxy_socket is None:
        return []
    return [os.path.realpath(sys.executable), "-I", "-S", RELAY, str(PROXY_PORT), net.proxy_socket, "--"]


def proxy_env(env: Mapping[str, str], proxied: bool) -> dict[str, str]:
    """``env`` with the proxy variables kandev sets: every form naming the relay and an empty
    ``NO_PROXY`` (``proxied``), or none of them at all (mode ``"none"``)."""
    out = {k: v for k, v in env.items() if k not in PROXY_VARIABLES and k not in NO_PROXY_VARIABLES}
    if proxied:
        out.update(dict.fromkeys(PROXY_VARIABLES, PROXY_URL))
        out.update(dict.fromkeys(NO_PROXY_VARIABLES, ""))
    return out
