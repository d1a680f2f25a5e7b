"""Issue 44 item 3 under real systemd (sdbox): runtime preparation by the backend's unit reaches npm's
registry and nothing else.

The units run as ``kandev`` with their hardening (``PrivateUsers=``, ``RestrictNamespaces=``, the
system-call filter). npm's registry is set where an operator sets it, in the service user's
``~/.npmrc`` (``/var/lib/kandev/.npmrc``), to a registry stand-in run inside the box on loopback
(tests/support/npm_registry_standin.py). ``kandev runtime update opencode`` then prepares the stand-in's
``opencode-ai`` through the preparation's proxy; its install script and its agent (the probe) find
another loopback port of the box refused through the proxy and unreachable directly, and the journal
has each refusal as ``network_refused`` with ``PURPOSE=runtime_preparation`` and the job's id.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from daemon.agents.registry import BUILTIN_AGENTS
from daemon.runtimes.npx_cache import NPX_DIR, npx_key
from tests.support.sdbox import SdBox

HOME = "/var/lib/kandev"
REGISTRY_PORT = 18473
OTHER_PORT = 18474
AGENT = BUILTIN_AGENTS["opencode"]
pytestmark = pytest.mark.timeout(300)


def test_issue_44_item_3_runtime_preparation_under_the_units_reaches_only_npms_registry(sdbox: SdBox) -> None:
    """Issue 44 item 3 under systemd: the install through the preparation's proxy from the registry in
    the service user's .npmrc works; another loopback port is refused (403 through the proxy, no
    route directly) from npm's install script and from the probe; the journal names the preparation."""
    sdbox.install_units()
    sdbox.write_file("/etc/kandev/kandev.toml", "")
    probes = {"other_port_proxied": {"kind": "proxied", "host": "127.0.0.1", "port": OTHER_PORT},
              "other_port_direct": {"kind": "direct", "host": "127.0.0.1", "port": OTHER_PORT}}
    standin = sdbox.repo_root / "tests/support/npm_registry_standin.py"
    sdbox.run("systemd-run", "--unit=npm-registry-standin", "--quiet", "/usr/bin/python3", str(standin),
              "--port", str(REGISTRY_PORT), "--package", AGENT.package, "--version", AGENT.version,
              "--bin", "opencode", "--probes", json.dumps(probes))
    sdbox.run("systemd-run", "--unit=other-port", "--quiet", "/usr/bin/python3", "-m", "http.server",
              "--bind", "127.0.0.1", str(OTHER_PORT), "--directory", "/var/empty")
    sdbox.systemctl("start", "kandev-backend.service")
    sdbox.write_file(f"{HOME}/.npmrc", f"registry=http://127.0.0.1:{REGISTRY_PORT}/\n", mode=0o600)
    sdbox.run("chown", "kandev:kandev", f"{HOME}/.npmrc")
    assert sdbox.wait_for(lambda: sdbox.run("python3", "-c", f"import socket; socket.create_connection(("
                                            f"'127.0.0.1', {REGISTRY_PORT}), 1)", check=False).returncode == 0,
                          timeout=30), "the registry stand-in did not start"

    proc = sdbox.run(str(sdbox.venv_bin / "kandev"), "--home", HOME, "--json", "runtime", "update", "opencode",
                     check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    job: dict[str, Any] = json.loads(proc.stdout)
    assert job["state"] == "succeeded", job
    assert f"npm reaches only 127.0.0.1:{REGISTRY_PORT}" in proc.stderr, proc.stderr

    tree = f"{HOME}/.npm/{NPX_DIR}/{npx_key(AGENT.npm_spec)}/node_modules/{AGENT.package}"
    for phase in ("install", "probe"):
        got = json.loads(sdbox.read_file(f"{tree}/net-{phase}.json"))
        assert got["registry"]["status"] == 200, (phase, got)
        assert got["other_port_proxied"]["status"] == 403, (phase, got)
        assert "npm's registry" in got["other_port_proxied"]["body"], (phase, got)
        assert got["other_port_direct"].get("error") == "ECONNREFUSED", (phase, got)

    refused = sdbox.journal_json("KANDEV_EVENT=network_refused")
    ours = [e for e in refused if e.get("PURPOSE") == "runtime_preparation" and e.get("JOB_ID") == job["job_id"]]
    assert {(e.get("HOST"), e.get("PORT"), e.get("REASON")) for e in ours} == {
        ("127.0.0.1", str(OTHER_PORT), "private_address")}, refused
    assert all("runtime preparation of opencode" in e.get("MESSAGE", "") for e in ours), ours
