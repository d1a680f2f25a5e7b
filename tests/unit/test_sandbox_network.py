"""The agent's network in its sandbox's command line (daemon.agentctl.sandbox.network): its own
namespace, the relay before the agent, the proxy variables (Issue 44 scenario A and Issue 44 scenario B)."""

from __future__ import annotations

import dataclasses

from daemon.agentctl.sandbox.bubblewrap import Bind, BindMode, SandboxView, build_argv
from daemon.agentctl.sandbox.network import PROXY_URL, PROXY_VARIABLES, RELAY, SandboxNet, proxy_env

VIEW = SandboxView(bwrap="/usr/bin/bwrap", uid=1000, gid=1000, binds=(Bind("/ws", BindMode.WRITABLE),), cwd="/ws")
COMMAND = ["/usr/bin/python3", "-m", "daemon.agents.mock"]


def test_issue_44_scenario_a_every_agent_has_a_network_namespace_and_the_relay_runs_first() -> None:
    """Issue 44 scenario A: ``--unshare-net`` before the command, the relay (with the session's
    socket) between the process cap and ``env``, the agent's command last; mode none: no relay."""
    argv = build_argv(dataclasses.replace(VIEW, net=SandboxNet("/run/egress/i1/proxy.sock")), COMMAND)
    command = argv[argv.index("--") + 1:]
    assert "--unshare-net" in argv[:argv.index("--")]
    relay = command.index(RELAY)
    assert command[relay + 1:relay + 4] == ["3128", "/run/egress/i1/proxy.sock", "--"]
    assert command.index("--default-signal=TERM") > relay and command[-3:] == COMMAND
    closed = build_argv(dataclasses.replace(VIEW, net=SandboxNet(None)), COMMAND)
    assert "--unshare-net" in closed and RELAY not in closed
    assert "--unshare-net" not in build_argv(VIEW, COMMAND)  # only the backend's checkout sandbox


def test_issue_44_scenario_b_proxy_variables_are_kandevs_own() -> None:
    """Issue 44 scenario B: every proxy variable names the relay and NO_PROXY is empty, whatever the
    agent's configuration said; with mode none there is no proxy variable at all."""
    configured = {"HTTPS_PROXY": "http://elsewhere:8080", "NO_PROXY": "*", "KEEP": "1"}
    proxied = proxy_env(configured, True)
    assert all(proxied[v] == PROXY_URL for v in PROXY_VARIABLES)
    assert proxied["NO_PROXY"] == proxied["no_proxy"] == "" and proxied["KEEP"] == "1"
    assert proxy_env(configured, False) == {"KEEP": "1"}
