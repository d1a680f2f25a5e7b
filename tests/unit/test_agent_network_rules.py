"""The rules of an agent's network (daemon.agents.network) and the request heads its egress proxy
accepts (daemon.agentctl.egress.request): Issue 44 scenario A, Issue 44 scenario B and Issue 44 scenario F, without a process."""

from __future__ import annotations

import ipaddress

import pytest

from daemon.agentctl.egress import request as http
from daemon.agents.network import (
    NetworkPolicy,
    RuleError,
    effective_policy,
    is_private_address,
    parse_host_port,
    parse_host_rule,
)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
    "224.0.0.1", "255.255.255.255", "::1", "::", "fd00::1", "fe80::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "2002:a9fe:a9fe::1", "64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1",
])
def test_issue_44_scenario_a_private_addresses_in_every_form_are_private(address: str) -> None:
    """Issue 44 scenario A: loopback, RFC 1918, link-local (the metadata service), CGNAT, ULA,
    multicast, and IPv6 forms that embed one (IPv4-mapped, 6to4, NAT64) are all private."""
    assert is_private_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_are_not_private(address: str) -> None:
    assert not is_private_address(ipaddress.ip_address(address))


def test_issue_44_scenario_b_names_ports_and_host_ports() -> None:
    """Issue 44 scenario B: an allow-listed name is admitted on its ports only; a private address
    only when host_ports lists it exactly (address and port), whatever the name asked for."""
    policy = effective_policy("allow-list", ["*.example.com", "model.test:8080"], ["127.0.0.1:8080"], "mock",
                              ["api.anthropic.com"])
    assert policy.check_name("api.anthropic.com", 443) is None
    assert policy.check_name("API.Anthropic.com.", 80) is None
    assert policy.check_name("api.anthropic.com", 8443) is not None
    assert policy.check_name("a.b.example.com", 443) is None
    assert policy.check_name("example.com", 443) is not None  # a glob is below the domain only
    assert policy.check_name("evil-example.com", 443) is not None
    assert policy.check_name("model.test", 8080) is None
    loopback = ipaddress.ip_address("127.0.0.1")
    assert policy.check_address(loopback, 8080) is None
    refused = policy.check_address(loopback, 8081)
    assert refused is not None and refused.reason == "private_address"
    assert refused.allow_with == '[network] host_ports = ["127.0.0.1:8081"]'
    assert policy.check_name("127.0.0.1", 8080) is None  # listed: asked for by address
    metadata = policy.check_name("169.254.169.254", 80)
    assert metadata is not None and metadata.reason == "private_address"
    opened = effective_policy("open", [], [], "mock")
    assert opened.check_name("anything.example.org", 1234) is None
    assert opened.check_address(ipaddress.ip_address("10.0.0.1"), 443) is not None


@pytest.mark.parametrize("rule", ["exa mple.com", "*.com", "a.*.example.com", "example.com:0", "example.com:70000",
                                  "-bad.example.com", "", "[::1", "ex_ample.com"])
def test_issue_44_scenario_f_malformed_rules_are_refused(rule: str) -> None:
    """Issue 44 scenario F: a malformed allow_hosts entry is refused with a reason."""
    with pytest.raises(RuleError):
        parse_host_rule(rule)


@pytest.mark.parametrize("entry", ["localhost:11434", "127.0.0.1", "::1:8080", "127.0.0.1:0", "10.0.0.1:x"])
def test_issue_44_scenario_f_malformed_host_ports_are_refused(entry: str) -> None:
    """Issue 44 scenario F: host_ports takes an IP address and a port, nothing else."""
    with pytest.raises(RuleError):
        parse_host_port(entry)


def test_policy_travels_as_written() -> None:
    policy = effective_policy("allow-list", ["a.example.com:8443", "[2001:db8::1]:443"], ["[::1]:8080"], "codex")
    assert NetworkPolicy.from_wire(policy.to_wire(), "codex") == policy
    with pytest.raises(RuleError):
        NetworkPolicy.from_wire({"mode": "allow-list", "extra": 1})


def test_request_heads_the_proxy_accepts() -> None:
    """Issue 44 scenario B: CONNECT and absolute http:// URLs; the forwarded head loses the proxy's
    own headers and says Connection: close; anything else is a bad request."""
    tunnel = http.parse(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\n")
    assert tunnel.connect and (tunnel.host, tunnel.port) == ("api.example.com", 443)
    v6 = http.parse(b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n")
    assert (v6.host, v6.port) == ("2001:db8::1", 8443)
    plain = http.parse(b"GET http://h.example.com:8080/a?b=c HTTP/1.1\r\nHost: h.example.com:8080\r\n"
                       b"Proxy-Authorization: x\r\nConnection: keep-alive\r\n\r\n")
    assert not plain.connect and (plain.host, plain.port) == ("h.example.com", 8080)
    assert plain.head == b"GET /a?b=c HTTP/1.1\r\nHost: h.example.com:8080\r\nConnection: close\r\n\r\n"
    for bad in (b"GET / HTTP/1.1\r\n\r\n", b"GET https://h.example.com/ HTTP/1.1\r\n\r\n",
                b"CONNECT h.example.com HTTP/1.1\r\n\r\n", b"GET http://u@h.example.com/ HTTP/1.1\r\n\r\n",
                b"garbage\r\n\r\n"):
        with pytest.raises(http.BadRequest):
            http.parse(bad)
    answer = http.close_connection(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n")
    assert answer == b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
