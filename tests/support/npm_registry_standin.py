"""A stand-in npm registry on loopback: one package, one version, written here (Issue 44 item 3).

``NpmRegistryStandIn(package, version, probes)`` serves, on ``127.0.0.1:<port>``, the packument of
``package`` (``GET /<name>``, the scope's ``/`` as ``%2f``) and its tarball (``GET
/<name>/-/<file>.tgz``), which npm installs as from any registry (``npm_config_registry`` = its
``url``). The package is a tiny Node ACP agent: its ``bin`` answers ``initialize`` (so kandev's
runtime probe passes) and its ``postinstall`` script and its ``bin`` first try each destination of
``probes`` (``{"name": {"kind": "proxied" | "direct" | "connect", "host": ..., "port": ...}}``) and
write what happened to ``<package dir>/net-<phase>.json`` (the registry itself, through the proxy,
as ``registry``): an HTTP status (``status``, the 403's
body in ``body``) or the error (``error``). ``requests`` lists the paths npm asked for.

Standard library only (the systemd test runs it inside its box as ``python3
npm_registry_standin.py --port N --package P --version V --bin B --probes JSON``); the package's
scripts use Node's ``http`` and ``net`` only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import io
import json
import tarfile
import threading
from typing import Any

CHECK_JS = r"""
const fs = require('fs'), http = require('http'), net = require('net'), path = require('path');
const probes = %(probes)s;
const proxy = new URL(process.env.HTTP_PROXY || 'http://127.0.0.1:1');
const out = {env_proxy: process.env.HTTP_PROXY || null};
const done = (phase) => fs.writeFileSync(path.join(__dirname, 'net-' + phase + '.json'), JSON.stringify(out));
function one(name, p) {
  return new Promise((resolve) => {
    const finish = (r) => { out[name] = r; resolve(); };
    const timer = setTimeout(() => finish({error: 'timeout'}), 10000);
    const end = (r) => { clearTimeout(timer); finish(r); };
    if (p.kind === 'direct') {
      const s = net.connect(p.port, p.host, () => { s.destroy(); end({connected: true}); });
      s.on('error', (e) => end({error: e.code || String(e)}));
    } else if (p.kind === 'connect') {
      const r = http.request({host: proxy.hostname, port: proxy.port, method: 'CONNECT', path: p.host + ':' + p.port});
      r.on('connect', (res, sock) => { sock.destroy(); end({status: res.statusCode}); });
      r.on('response', (res) => { let b = ''; res.on('data', (c) => b += c); res.on('end', () => end({status: res.statusCode, body: b})); });
      r.on('error', (e) => end({error: e.code || String(e)}));
      r.end();
    } else {
      const r = http.request({host: proxy.hostname, port: proxy.port, method: 'GET', path: 'http://' + p.host + ':' + p.port + (p.path || '/')});
      r.on('response', (res) => { let b = ''; res.on('data', (c) => b += c); res.on('end', () => end({status: res.statusCode, body: b})); });
      r.on('error', (e) => end({error: e.code || String(e)}));
      r.end();
    }
  });
}
module.exports = async function check(phase) {
  for (const [name, p] of Object.entries(probes)) await one(name, p);
  done(phase);
};
if (require.main === module) module.exports(process.argv[2]);
"""

AGENT_JS = r"""#!/usr/bin/env node
// A minimal ACP agent: answers initialize, nothing else.
const check = require('./check.js');
let buf = '';
let checked = check('probe').catch(() => {});
process.stdin.on('data', async (chunk) => {
  buf += chunk;
  let i;
  while ((i = buf.indexOf('\n')) >= 0) {
    const line = buf.slice(0, i); buf = buf.slice(i + 1);
    let msg; try { msg = JSON.parse(line); } catch (e) { continue; }
    if (msg.method === 'initialize') {
      await checked;
      process.stdout.write(JSON.stringify({jsonrpc: '2.0', id: msg.id, result: {
        protocolVersion: %(protocol)d, agentCapabilities: {}, authMethods: [],
        agentInfo: {name: 'registry-standin-agent', version: '%(version)s'}}}) + '\n');
    } else if (msg.id !== undefined) {
      process.stdout.write(JSON.stringify({jsonrpc: '2.0', id: msg.id, error: {code: -32601, message: 'no'}}) + '\n');
    }
  }
});
"""


def _tarball(package: str, version: str, bin_name: str, probes: dict[str, Any], protocol: int) -> bytes:
    files = {
        "package/package.json": (json.dumps({
            "name": package, "version": version, "bin": {bin_name: "agent.js"},
            "scripts": {"postinstall": "node check.js install"},
        }).encode(), 0o644),
        "package/check.js": ((CHECK_JS % {"probes": json.dumps(probes)}).encode(), 0o644),
        "package/agent.js": ((AGENT_JS % {"protocol": protocol, "version": version}).encode(), 0o755),
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


class NpmRegistryStandIn:
    """The registry (see the module docstring); a context manager."""

    def __init__(self, package: str, version: str, bin_name: str, probes: dict[str, Any], protocol: int = 1,
                 port: int = 0) -> None:
        self.package, self.version, self.bin_name = package, version, bin_name
        self.requests: list[str] = []
        standin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                standin.requests.append(self.path)
                body, kind = standin.answer(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                data = body if body is not None else b'{"error":"not found"}'
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        own = {"registry": {"kind": "proxied", "host": "127.0.0.1", "port": self.port,  # itself, through the proxy
                            "path": "/" + package.replace("/", "%2f")}}
        self.tarball = _tarball(package, version, bin_name, {**probes, **own}, protocol)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def file_name(self) -> str:
        return f"{self.package.rsplit('/', 1)[-1]}-{self.version}.tgz"

    def packument(self) -> bytes:
        tarball_url = f"{self.url}{self.package}/-/{self.file_name}"
        integrity = "sha512-" + base64.b64encode(hashlib.sha512(self.tarball).digest()).decode()
        doc = {"name": self.package, "dist-tags": {"latest": self.version}, "versions": {self.version: {
            "name": self.package, "version": self.version,
            "bin": {self.bin_name: "agent.js"},
            "scripts": {"postinstall": "node check.js install"},
            "dist": {"tarball": tarball_url, "integrity": integrity,
                     "shasum": hashlib.sha1(self.tarball).hexdigest()}}}}  # noqa: S324 (npm's own field)
        return json.dumps(doc).encode()

    def answer(self, path: str) -> tuple[bytes | None, str]:
        name = path.split("?", 1)[0].lstrip("/").replace("%2f", "/").replace("%2F", "/")
        if name == self.package:
            return self.packument(), "application/json"
        if name == f"{self.package}/-/{self.file_name}":
            return self.tarball, "application/octet-stream"
        return None, "application/json"

    def __enter__(self) -> NpmRegistryStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--package", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--bin", required=True)
    parser.add_argument("--probes", default="{}", help="JSON: {name: {kind, host, port}}")
    args = parser.parse_args(argv)
    standin = NpmRegistryStandIn(args.package, args.version, args.bin, json.loads(args.probes), port=args.port)
    standin.server.serve_forever()


if __name__ == "__main__":
    main()
