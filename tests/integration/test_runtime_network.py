"""Runtime preparation reaches npm's registry and nothing else (Issue 44 item 3, Issue 44 scenario B).

A real backend runs ``kandev runtime update opencode`` with npm configured (``npm_config_registry``)
to a registry stand-in on loopback (tests/support/npm_registry_standin.py), which serves a tiny
``opencode-ai`` of the pinned version: its install script and its ACP agent, run by npm and by
kandev's probe inside the preparation sandbox, try other destinations and write down what
happened. The registry is not in any ``[network]`` key: it is reachable because npm is configured
with it, through the preparation's own proxy. Another loopback port of the host (a server the test
runs) is refused through the proxy (403, ``network_refused`` naming the runtime preparation, a
line among the job's events) and unreachable directly (the preparation has a network namespace of
its own); a public host is refused too. The server never sees a request.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.agents.registry import BUILTIN_AGENTS
from daemon.runtimes.npx_cache import NPX_DIR, npx_key
from tests.support.npm_registry_standin import NpmRegistryStandIn

pytestmark = [pytest.mark.timeout(240)]

AGENT = BUILTIN_AGENTS["opencode"]


class _Listener:
    """A host loopback TCP port that counts who connected (none may)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _results(cache: Path, phase: str) -> dict[str, Any]:
    tree = cache / NPX_DIR / npx_key(AGENT.npm_spec) / "node_modules" / AGENT.package
    data: dict[str, Any] = json.loads((tree / f"net-{phase}.json").read_text())
    return data


def test_issue_44_item_3_runtime_preparation_reaches_only_npms_registry(kandev_factory: Any, short_tmp: Path) -> None:
    """Issue 44 item 3 (Issue 44 scenario B for runtime preparation): an install through the
    preparation's proxy from npm's (loopback) registry works; from inside the preparation sandbox
    (npm's install script, the probe's agent) another host loopback port is refused through the
    proxy and unreachable directly, a public host is refused, and each refusal is visible."""
    other = _Listener()
    probes = {
        "other_port_proxied": {"kind": "proxied", "host": "127.0.0.1", "port": other.port},
        "other_port_direct": {"kind": "direct", "host": "127.0.0.1", "port": other.port},
        "public_host": {"kind": "connect", "host": "registry.example.com", "port": 443},
    }
    cache = short_tmp / "npm"
    try:
        with NpmRegistryStandIn(AGENT.package, AGENT.version, "opencode", probes) as registry:
            k = kandev_factory("rt", npm_config_registry=registry.url, npm_config_cache=str(cache))
            k.up()
            proc = k.run("runtime", "update", "opencode", timeout=200)
            assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
            job = json.loads(proc.stdout)
            assert job["state"] == "succeeded", job
            # npm fetched the package from the stand-in, through the proxy
            assert any(r.lstrip("/") == AGENT.package for r in registry.requests), registry.requests
            assert any(r.endswith(".tgz") for r in registry.requests), registry.requests

        for phase in ("install", "probe"):
            got = _results(cache, phase)
            assert got["env_proxy"] == "http://127.0.0.1:3128", (phase, got)
            assert got["registry"]["status"] == 200, (phase, got)  # exactly npm's registry: reachable
            refused = got["other_port_proxied"]
            assert refused["status"] == 403, (phase, got)
            assert f"refused 127.0.0.1:{other.port}: a private address" in refused["body"], (phase, got)
            assert "npm's registry" in refused["body"], (phase, got)
            assert "connected" not in got["other_port_direct"], (phase, got)  # its own network namespace
            assert got["other_port_direct"]["error"] == "ECONNREFUSED", (phase, got)
            assert got["public_host"]["status"] == 403, (phase, got)
        assert other.accepted == 0

        # visible: the job's events, and network_refused naming the runtime preparation
        progress = proc.stderr  # the job's events, as `kandev runtime update` prints them
        print(progress)
        assert "npm reaches only 127.0.0.1:" in progress, progress
        assert f"[updating] refused 127.0.0.1:{other.port}: a private address" in progress, progress
        assert f"[refreshing] refused 127.0.0.1:{other.port}: a private address" in progress, progress
        assert "refused registry.example.com:443: not in the allow-list" in progress, progress
        log = (k.home / "logs" / "backend.log").read_text(errors="replace")
        refusals = [line for line in log.splitlines() if " network_refused " in line]
        assert any(f"runtime preparation of opencode (runtime job {job['job_id']}): refused 127.0.0.1:{other.port}"
                   in line and "purpose=runtime_preparation" in line for line in refusals), refusals
    finally:
        other.close()
