"""Where runtime preparation may go: npm's configuration as the backend's npm reads it, and the
network policy that admits its registry and nothing else (Issue 44 item 3; pure but for ``read``).

A runtime job (``daemon.runtimes.update``) runs npm and the ACP probe in a sandbox of its own whose
only way out is an egress proxy (``daemon.backend.sessions.runtime_sandbox``). What that proxy
admits comes from npm's own configuration, asked once per job, outside the sandbox, with one
direct command (``config_argv``: ``npm config get cache registry userconfig globalconfig
[@scope:registry]``, the scope of the agent's package when it has one):

- ``registry`` (and the package scope's registry, when one is configured) is the only destination:
  its host and port (``endpoint``: 443 for ``https``, 80 for ``http`` when the URL names none);
- a registry whose host is, or resolves to, a private address (a loopback mirror such as
  Verdaccio on ``127.0.0.1:4873``, a registry on the office network) is admitted at exactly those
  addresses and that port (``host_ports``); every other private destination stays refused, as for
  agents;
- ``cache``, ``userconfig`` and ``globalconfig`` say what the sandbox binds (the cache read-write,
  the two files read-only) and are handed to npm inside explicitly, so it reads the same
  configuration there.

Refusals name npm's registry setting as what would allow a destination (``ALLOW_WITH``): no kandev
key widens what runtime preparation reaches.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from daemon.agents.network import (
    MODE_ALLOW_LIST,
    HostPort,
    NetworkPolicy,
    is_private_address,
    parse_host_rule,
    parse_ip,
)
from daemon.runtimes.npx_cache import RepairRefused, check_cache_root

CONFIG_TIMEOUT_S = 30.0
DEFAULT_PORTS = {"https": 443, "http": 80}
ALLOW_WITH = ("npm's registry (`npm config get registry`, as the backend's npm reads it): runtime preparation"
              " reaches that registry and nothing else")
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class RegistryError(ValueError):
    """npm's configuration cannot be used for runtime preparation; the message says why."""


@dataclass(frozen=True)
class Endpoint:
    """One registry's host (lower case, an address compressed) and port."""

    host: str
    port: int

    def render(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class NpmSettings:
    """What runtime preparation takes of npm's configuration."""

    cache: Path
    registries: tuple[str, ...]  # the registry first, then the package scope's own, if any
    userconfig: str | None
    globalconfig: str | None

    @property
    def registry(self) -> str:
        return self.registries[0]


def scope_of(package: str) -> str | None:
    """``@scope`` of a scoped package name, None for an unscoped one."""
    return package.split("/", 1)[0] if package.startswith("@") and "/" in package else None


def config_argv(package: str, logs_dir: Path) -> list[str]:
    """The one npm command that reads what runtime preparation needs (no network, no log file).
    ``logs_dir``: an empty directory of ours, because ``--logs-max=0`` makes npm delete every
    earlier debug log in its logs directory (the cache's ``_logs`` unless told otherwise)."""
    keys = ["cache", "registry", "userconfig", "globalconfig"]
    scope = scope_of(package)
    if scope is not None:
        keys.append(f"{scope}:registry")
    return ["npm", "config", "get", *keys, "--logs-max=0", f"--logs-dir={logs_dir}"]


def endpoint(url: str) -> Endpoint:
    """The host and port of a registry URL; RegistryError naming the URL when it is not one."""
    shown = url[:200]
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise RegistryError(f"npm's registry {shown!r} is not a URL: {exc}") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise RegistryError(f"npm's registry {shown!r} is not an http:// or https:// URL")
    if not parts.hostname:
        raise RegistryError(f"npm's registry {shown!r} names no host")
    host = parts.hostname.lower().rstrip(".")
    ip = parse_ip(host)
    if ip is not None:
        host = str(ip)
    else:
        try:
            parse_host_rule(host)
        except ValueError as exc:
            raise RegistryError(f"npm's registry {shown!r}: {exc}") from None
    return Endpoint(host, port or DEFAULT_PORTS[parts.scheme])


def parse_config(text: str, package: str) -> NpmSettings:
    """``config_argv``'s output (``key=value`` lines) as settings; RegistryError when one is unusable."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()

    def given(key: str) -> str | None:
        value = values.get(key)
        return value if value and value not in ("undefined", "null") else None

    registry = given("registry")
    if registry is None:
        raise RegistryError(f"npm reported no registry (`npm config get registry`): {text[:200]!r}")
    registries = [registry]
    scope = scope_of(package)
    scoped = given(f"{scope}:registry") if scope else None
    if scoped is not None and scoped != registry:
        registries.append(scoped)
    for url in registries:
        endpoint(url)  # each must be a usable URL
    try:
        cache = check_cache_root(values.get("cache", ""))
    except RepairRefused as exc:
        raise RegistryError(f"refusing npm's cache directory: {exc}") from None
    return NpmSettings(cache, tuple(registries), given("userconfig"), given("globalconfig"))


def read(package: str, env: Mapping[str, str], cwd: Path) -> NpmSettings:
    """Ask npm (blocking; outside any sandbox: it only reads its configuration files)."""
    argv = config_argv(package, cwd / ".npm-config-logs")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CONFIG_TIMEOUT_S, env=dict(env),
                              cwd=cwd, stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise RegistryError(f"npm is not on the backend's PATH ({env.get('PATH', '')[:200]}): preparing a"
                            " runtime needs node and npm (the Debian package depends on both)") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegistryError(f"cannot ask npm for its configuration: {exc}") from None
    if done.returncode != 0:
        raise RegistryError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return parse_config(done.stdout, package)


def policy(endpoints: Iterable[Endpoint], resolved: Mapping[str, Iterable[Address]], agent: str) -> NetworkPolicy:
    """The allow-list of exactly ``endpoints`` (each ``host:port``); a registry whose host is or
    resolves (``resolved``: host -> its addresses) to a private address is admitted at exactly
    those addresses and its port, nothing else private."""
    rules, ports = [], []
    for end in endpoints:
        rules.append(parse_host_rule(end.render()))
        literal = parse_ip(end.host)
        addresses = [literal] if literal is not None else list(resolved.get(end.host, ()))
        for ip in addresses:
            listed = HostPort(ip, end.port)
            if is_private_address(ip) and listed not in ports:
                ports.append(listed)
    return NetworkPolicy(MODE_ALLOW_LIST, tuple(dict.fromkeys(rules)), tuple(ports), agent, allow_with=ALLOW_WITH)
