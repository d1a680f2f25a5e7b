"""What runtime preparation may reach: npm's registry and nothing else (Issue 44 item 3).

``daemon.runtimes.registry`` reads npm's configuration and builds the preparation proxy's policy;
``daemon.backend.sessions.runtime_sandbox.sandbox_env`` is what the sandboxed npm gets of the
backend's environment. Pure: no npm, no socket.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from daemon.agentctl.sandbox.network import PROXY_URL
from daemon.backend.sessions.runtime_sandbox import sandbox_env
from daemon.runtimes import registry
from daemon.runtimes.registry import Endpoint, RegistryError

IP = ipaddress.ip_address


@pytest.mark.parametrize(("url", "expected"), [
    ("https://registry.npmjs.org/", Endpoint("registry.npmjs.org", 443)),
    ("http://registry.example.com", Endpoint("registry.example.com", 80)),
    ("https://user:secret@Npm.Corp.Example:8443/npm/", Endpoint("npm.corp.example", 8443)),
    ("http://127.0.0.1:4873/", Endpoint("127.0.0.1", 4873)),
    ("http://[::1]:4873/", Endpoint("::1", 4873)),
    ("http://localhost:4873", Endpoint("localhost", 4873)),
])
def test_a_registry_url_is_one_host_and_port(url: str, expected: Endpoint) -> None:
    """Issue 44 item 3: the registry's host:port, the scheme's port when the URL names none."""
    assert registry.endpoint(url) == expected


@pytest.mark.parametrize(("url", "why"), [
    ("ftp://registry.example.com/", "not an http:// or https:// URL"),
    ("https:///path", "names no host"),
    ("http://registry.example.com:99999/", "is not a URL"),
    ("registry.example.com", "not an http:// or https:// URL"),
])
def test_a_registry_that_is_no_url_is_refused_naming_it(url: str, why: str) -> None:
    """Issue 44 item 3: a registry setting that is not one is refused, naming it and why."""
    with pytest.raises(RegistryError, match=why) as err:
        registry.endpoint(url)
    assert url[:20] in str(err.value)


def test_npms_configuration_is_read_from_one_command() -> None:
    """Issue 44 item 3: ``npm config get`` of the keys runtime preparation needs, with the package
    scope's registry; ``undefined`` is no setting."""
    argv = registry.config_argv("@google/gemini-cli", Path("/x/logs"))
    assert argv[:3] == ["npm", "config", "get"] and "@google:registry" in argv and "--logs-dir=/x/logs" in argv
    assert "@" not in " ".join(registry.config_argv("opencode-ai", Path("/x")))
    out = ("cache=/var/cache/npm\nregistry=https://registry.npmjs.org/\nuserconfig=/root/.npmrc\n"
           "globalconfig=/usr/etc/npmrc\n@google:registry=undefined\n")
    settings = registry.parse_config(out, "@google/gemini-cli")
    assert settings.cache == Path("/var/cache/npm") and settings.registries == ("https://registry.npmjs.org/",)
    assert (settings.userconfig, settings.globalconfig) == ("/root/.npmrc", "/usr/etc/npmrc")
    scoped = registry.parse_config(out.replace("@google:registry=undefined", "@google:registry=https://g.example/"),
                                   "@google/gemini-cli")
    assert scoped.registries == ("https://registry.npmjs.org/", "https://g.example/")
    with pytest.raises(RegistryError, match="no registry"):
        registry.parse_config("cache=/var/cache/npm\nregistry=undefined\n", "opencode-ai")
    with pytest.raises(RegistryError, match="cache"):
        registry.parse_config("cache=/\nregistry=https://registry.npmjs.org/\n", "opencode-ai")


def test_the_policy_admits_exactly_the_registry() -> None:
    """Issue 44 item 3: a public registry is the one destination, at its port only; anything else
    is refused naming npm's registry setting (no kandev key widens it)."""
    p = registry.policy([Endpoint("registry.npmjs.org", 443)], {"registry.npmjs.org": [IP("104.16.1.35")]}, "codex")
    assert p.host_ports == () and p.mode == "allow-list"
    assert p.check_name("registry.npmjs.org", 443) is None
    assert p.check_address(IP("104.16.1.35"), 443) is None
    for host, port in (("registry.npmjs.org", 80), ("github.com", 443), ("api.openai.com", 443)):
        refusal = p.check_name(host, port)
        assert refusal is not None and refusal.reason == "not_allowed", (host, port)
        assert "npm's registry" in refusal.allow_with and "[network]" not in refusal.allow_with
    refusal = p.check_address(IP("169.254.169.254"), 443)  # a public name that resolves privately
    assert refusal is not None and refusal.reason == "private_address"


def test_a_private_registry_is_reachable_at_exactly_its_address_and_port() -> None:
    """Issue 44 item 3: a registry on a private or loopback address is reachable only at exactly
    that address and port; every other private destination stays refused."""
    loop = registry.policy([Endpoint("127.0.0.1", 4873)], {}, "opencode")
    assert [h.render() for h in loop.host_ports] == ["127.0.0.1:4873"]
    assert loop.check_name("127.0.0.1", 4873) is None
    for ip, port in (("127.0.0.1", 4874), ("127.0.0.2", 4873), ("10.0.0.1", 4873), ("169.254.169.254", 80)):
        refusal = loop.check_name(ip, port)
        assert refusal is not None and refusal.reason == "private_address", (ip, port)
    named = registry.policy([Endpoint("npm.corp.example", 443)], {"npm.corp.example": [IP("10.1.2.3")]}, "codex")
    assert [h.render() for h in named.host_ports] == ["10.1.2.3:443"]
    assert named.check_name("npm.corp.example", 443) is None and named.check_address(IP("10.1.2.3"), 443) is None
    assert named.check_address(IP("10.1.2.4"), 443) is not None
    assert named.check_name("10.1.2.3", 80) is not None
    local = registry.policy([Endpoint("localhost", 4873)], {"localhost": [IP("127.0.0.1"), IP("::1")]}, "codex")
    assert sorted(h.render() for h in local.host_ports) == ["127.0.0.1:4873", "[::1]:4873"]


def test_the_sandboxed_npm_gets_npms_settings_and_the_proxy_and_nothing_else(tmp_path: Path) -> None:
    """Issue 44 item 3: the preparation's environment keeps npm's own settings, the locale and the
    CA variables, points npm and every proxy variable at the relay, and drops the rest of the
    backend's (its secrets, its own proxy, kandev's variables)."""
    backend = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "ANTHROPIC_API_KEY": "sk-secret", "KANDEV_CONFIG": "/etc/kandev/kandev.toml",
               "npm_config_fund": "false", "NPM_CONFIG_UPDATE_NOTIFIER": "false",
               "npm_config_registry": "https://elsewhere.example/", "NPM_CONFIG_HTTPS_PROXY": "http://corp:3128",
               "HTTPS_PROXY": "http://corp:3128", "NO_PROXY": "*", "NODE_EXTRA_CA_CERTS": "/etc/ssl/corp.pem",
               "TMPDIR": "/var/tmp/backend"}
    settings = registry.NpmSettings(Path("/var/cache/npm"), ("https://registry.npmjs.org/",), "/root/.npmrc", None)
    env = sandbox_env(backend, settings, tmp_path / "home")
    assert "ANTHROPIC_API_KEY" not in env and "KANDEV_CONFIG" not in env and "TMPDIR" not in env
    assert "NPM_CONFIG_HTTPS_PROXY" not in env
    assert env["npm_config_fund"] == "false" and env["NPM_CONFIG_UPDATE_NOTIFIER"] == "false"
    assert env["npm_config_registry"] == "https://registry.npmjs.org/"
    assert env["npm_config_cache"] == "/var/cache/npm" and env["npm_config_userconfig"] == "/root/.npmrc"
    assert env["npm_config_proxy"] == env["npm_config_https_proxy"] == PROXY_URL and env["npm_config_noproxy"] == ""
    assert env["HTTPS_PROXY"] == env["http_proxy"] == PROXY_URL and env["NO_PROXY"] == env["no_proxy"] == ""
    assert env["HOME"] == str(tmp_path / "home") and env["LANG"] == "C.UTF-8" and env["LC_ALL"] == "C.UTF-8"
    assert env["NODE_EXTRA_CA_CERTS"] == "/etc/ssl/corp.pem" and env["PATH"] == "/usr/bin:/bin"


def test_without_npm_the_preparation_says_so(tmp_path: Path) -> None:
    """Issue 44 item 3: npm missing from the backend's PATH is a clear refusal, not a crash."""
    with pytest.raises(RegistryError, match="npm is not on the backend's PATH"):
        registry.read("opencode-ai", {"PATH": str(tmp_path)}, tmp_path)
