"""What network an agent may reach: the rules of ``[network]`` and ``[agents.NAME]`` and how one
destination is judged against them (pure: no socket, no resolver).

Every agent runs in a network namespace of its own (``daemon.agentctl.sandbox.network``) whose only
way out is its session's egress proxy in the control server (``daemon.agentctl.egress``). The
proxy asks this module twice per connection:

1. ``NetworkPolicy.check_name(host, port)``: may the agent ask for this destination at all?
   ``"open"`` admits any name; ``"allow-list"`` admits a name one of the rules matches (the
   agent's built-in provider hosts, ``[network] allow_hosts``, ``[agents.NAME] allow_hosts``) and an
   address listed in ``[network] host_ports``;
2. ``NetworkPolicy.check_address(ip, port)``: may the proxy connect to this address, which the
   name resolved to? A private address (``is_private_address``: loopback, RFC 1918, link-local
   including the cloud metadata service 169.254.169.254, CGNAT 100.64/10, ULA, multicast,
   unspecified, reserved, and IPv6 forms that embed one: IPv4-mapped, 6to4, NAT64, Teredo) is
   refused in every mode unless ``ip:port`` is listed exactly in ``host_ports``. The proxy judges
   the address it actually connects to, so a public name that resolves to a private address is
   refused.

Rules (``parse_host_rule``): a host name (``api.anthropic.com``), a glob of one leading label
(``*.example.com``: any name below example.com, not example.com itself) or an IP address, each
optionally with ``:port`` (without one: ports 443 and 80). ``host_ports`` entries
(``parse_host_port``): an IP address and a port, ``127.0.0.1:11434`` or ``[::1]:8080``.

Refusals (``Refusal``) carry a short reason code, a sentence, and the configuration key that would
allow the destination, for the proxy's 403 and the ``network_refused`` journal entry.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MODES = ("allow-list", "none", "open")
MODE_ALLOW_LIST, MODE_NONE, MODE_OPEN = MODES
DEFAULT_PORTS = (443, 80)
MAX_RULES = 256
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


class RuleError(ValueError):
    """A rule or address as written is refused; the message says why (the caller names the key)."""


# ---------------------------------------------------------------- addresses


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches through: IPv4-mapped, 6to4, NAT64, Teredo."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def is_private_address(ip: _IPAddress) -> bool:
    """Whether ``ip`` is anything but a public unicast address (see the module docstring)."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_ipv4(ip)
        if inner is not None and is_private_address(inner):
            return True
        if ip.scope_id:
            return True
    if ip.is_multicast or ip.is_unspecified or ip.is_loopback or ip.is_link_local or ip.is_private:
        return True
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return True
    return not ip.is_global


def parse_ip(text: str) -> _IPAddress | None:
    """``text`` as an IP address (IPv6 with or without brackets), None if it is not one."""
    t = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return ipaddress.ip_address(t)
    except ValueError:
        return None


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise RuleError(f"{what} has port {text!r}, not a number in 1..65535")
    return int(text)


# ---------------------------------------------------------------- rules


@dataclass(frozen=True)
class HostRule:
    """One ``allow_hosts`` entry: a name, a ``*.`` glob or an address, and the ports it admits."""

    host: str  # lower case; "*.example.com" for a glob; an address in its compressed form
    ports: tuple[int, ...] = DEFAULT_PORTS

    def matches(self, host: str, port: int) -> bool:
        if port not in self.ports:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def render(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.ports == DEFAULT_PORTS else f"{host}:{self.ports[0]}"


def normalise_host(host: str) -> str:
    """A requested host as rules compare it: lower case, no trailing dot, an address compressed."""
    ip = parse_ip(host)
    if ip is not None:
        return str(ip)
    return host.lower().rstrip(".")


def parse_host_rule(text: Any) -> HostRule:
    """One ``allow_hosts`` entry (see the module docstring); RuleError saying why not."""
    if not isinstance(text, str) or not text or len(text) > 260 or any(c.isspace() or c == "\0" for c in text):
        raise RuleError(f"{text!r:.80} is not a host name, *.domain glob or address (optionally :port)")
    host = text
    ports: tuple[int, ...] = DEFAULT_PORTS
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0:
            raise RuleError(f"{text!r} has an unclosed [")
        host, rest = text[: end + 1], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise RuleError(f"{text!r}: expected :port after ]")
            ports = (_port(rest[1:], repr(text)),)
    elif text.count(":") == 1:
        host, port = text.split(":")
        ports = (_port(port, repr(text)),)
    ip = parse_ip(host)
    if ip is not None:
        return HostRule(str(ip), ports)
    if ":" in host:
        raise RuleError(f"{text!r} is not an address: write an IPv6 address in brackets, [::1]:8080")
    name = host.lower().rstrip(".")
    labels = name.split(".")
    glob = labels[0] == "*"
    if glob:
        labels = labels[1:]
        if len(labels) < 2:
            raise RuleError(f"{text!r}: a glob needs a domain of two labels at least (*.example.com)")
    if "*" in name.lstrip("*"):
        raise RuleError(f"{text!r}: '*' is allowed only as the whole first label (*.example.com)")
    if not labels or not all(_LABEL.match(label) for label in labels):
        raise RuleError(f"{text!r} is not a host name (letters, digits, '-' and '.'; a glob as *.example.com)")
    return HostRule(name, ports)


@dataclass(frozen=True)
class HostPort:
    """One ``host_ports`` entry: an exact address and port a private destination may be."""

    ip: _IPAddress
    port: int

    def render(self) -> str:
        return f"[{self.ip}]:{self.port}" if self.ip.version == 6 else f"{self.ip}:{self.port}"


def parse_host_port(text: Any) -> HostPort:
    """One ``host_ports`` entry, ``IP:PORT`` (IPv6 in brackets); RuleError saying why not."""
    if not isinstance(text, str) or not text:
        raise RuleError(f"{text!r:.80} is not ADDRESS:PORT (e.g. \"127.0.0.1:11434\")")
    host, sep, port = text.rpartition(":")
    ip = parse_ip(host) if sep else None
    if ip is None or (ip.version == 6 and not host.startswith("[")):
        raise RuleError(f"{text!r:.80} is not ADDRESS:PORT with an IP address (e.g. \"127.0.0.1:11434\","
                        " \"[::1]:8080\"); a host name is not accepted here")
    return HostPort(ip, _port(port, repr(text)))


def parse_rules(values: Iterable[Any]) -> tuple[HostRule, ...]:
    out = tuple(parse_host_rule(v) for v in values)
    if len(out) > MAX_RULES:
        raise RuleError(f"at most {MAX_RULES} entries")
    return out


def parse_host_ports(values: Iterable[Any]) -> tuple[HostPort, ...]:
    out = tuple(parse_host_port(v) for v in values)
    if len(out) > MAX_RULES:
        raise RuleError(f"at most {MAX_RULES} entries")
    return out


def check_mode(value: Any) -> str:
    if not isinstance(value, str) or value not in MODES:
        raise RuleError(f"{value!r:.80} is not one of " + ", ".join(f'"{m}"' for m in MODES))
    return value


# ---------------------------------------------------------------- one agent's policy


@dataclass(frozen=True)
class Refusal:
    """Why a destination is refused: a reason code, a sentence, and the key that would allow it."""

    reason: str  # "not_allowed" | "private_address" | "unresolvable" | "bad_request"
    message: str
    allow_with: str = ""


@dataclass(frozen=True)
class NetworkPolicy:
    """One agent's network (``create_instance``'s ``network`` field): the mode, the host rules
    (built-in ones of its agent first) and the exact private destinations allowed."""

    mode: str = MODE_ALLOW_LIST
    allow_hosts: tuple[HostRule, ...] = ()
    host_ports: tuple[HostPort, ...] = ()
    agent: str = ""
    builtin: tuple[str, ...] = field(default=(), compare=False)  # the agent's built-in rules, as written
    allow_with: str = field(default="", compare=False)  # what would allow a refused destination, when not
    # the agents' keys (runtime preparation: npm's registry setting)

    def to_wire(self) -> dict[str, Any]:
        return {"mode": self.mode, "allow_hosts": [r.render() for r in self.allow_hosts],
                "host_ports": [h.render() for h in self.host_ports]}

    @classmethod
    def from_wire(cls, doc: Any, agent: str = "") -> NetworkPolicy:
        """Parse ``create_instance``'s ``network`` field; RuleError naming the field."""
        if not isinstance(doc, dict):
            raise RuleError("'network' must be a map {mode, allow_hosts, host_ports}")
        unknown = sorted(set(doc) - {"mode", "allow_hosts", "host_ports"})
        if unknown:
            raise RuleError(f"'network' has unknown field(s) {unknown}")
        hosts, ports = doc.get("allow_hosts", []), doc.get("host_ports", [])
        if not isinstance(hosts, list) or not isinstance(ports, list):
            raise RuleError("'network.allow_hosts' and 'network.host_ports' must be lists of strings")
        try:
            mode = check_mode(doc.get("mode", MODE_ALLOW_LIST))
        except RuleError as exc:
            raise RuleError(f"'network.mode': {exc}") from None
        return cls(mode, parse_rules(hosts), parse_host_ports(ports), agent)

    @property
    def proxied(self) -> bool:
        """Whether the agent gets a proxy at all (``"none"``: no way out)."""
        return self.mode != MODE_NONE

    def _listed(self, ip: _IPAddress | None, port: int) -> bool:
        return ip is not None and any(h.ip == ip and h.port == port for h in self.host_ports)

    def check_name(self, host: str, port: int) -> Refusal | None:
        """May the agent ask for ``host:port``? None: yes (the address is judged next)."""
        name = normalise_host(host)
        literal = parse_ip(name)
        if literal is not None and is_private_address(literal):
            return self.check_address(literal, port)  # only host_ports can allow it, in any mode
        if self.mode == MODE_OPEN or self._listed(literal, port):
            return None
        if self.mode == MODE_NONE:  # no proxy is given then; never reached in practice
            return Refusal("not_allowed", "network mode \"none\"", "[network] mode")
        if any(rule.matches(name, port) for rule in self.allow_hosts):
            return None
        agent = f"[agents.{self.agent}]" if self.agent else "[agents.NAME]"
        shown = f"[{name}]" if ":" in name else name
        return Refusal("not_allowed", "not in the allow-list",
                       self.allow_with or f'[network] allow_hosts (or {agent} allow_hosts) = ["{shown}:{port}"]')

    def check_address(self, ip: _IPAddress, port: int) -> Refusal | None:
        """May the proxy connect to ``ip:port``? Private addresses only when listed exactly."""
        if not is_private_address(ip) or self._listed(ip, port):
            return None
        shown = HostPort(ip, port).render()
        return Refusal("private_address", "a private address",
                       self.allow_with or f'[network] host_ports = ["{shown}"]')


def effective_policy(mode: str, allow_hosts: Sequence[str], host_ports: Sequence[str], agent: str,
                     builtin: Sequence[str] = ()) -> NetworkPolicy:
    """The policy of one launch from already checked configuration values."""
    return NetworkPolicy(check_mode(mode), parse_rules([*builtin, *allow_hosts]), parse_host_ports(host_ports),
                         agent, tuple(builtin))


def describe(policy: NetworkPolicy) -> Mapping[str, Any]:
    """What ``kandev agents`` shows of an agent's network."""
    return {"mode": policy.mode, "allow_hosts": [r.render() for r in policy.allow_hosts],
            "builtin": list(policy.builtin), "host_ports": [h.render() for h in policy.host_ports]}
