"""A local stand-in for GitHub's git smart-HTTP service (Issue 20): ``git http-backend`` behind a
small HTTP server on loopback that accepts exactly one token.

``GitStandin(root, token)`` serves the bare repositories under ``root`` (``<owner>/<name>.git``)
at ``http://127.0.0.1:<port>/<owner>/<name>.git`` the way GitHub does: every request needs HTTP
Basic authentication whose password is the configured token (any other answer is a 401 and never
reaches ``git http-backend``); fetch, clone and push (``git-receive-pack``) go through the real
``git http-backend``. Every request is logged, in order, as one line in ``requests`` (and in
``<root>/requests.log``)::

    POST /example/repo.git/git-receive-pack auth=token status=200

``auth`` is ``token`` (the configured token was presented), ``missing`` or ``wrong``; the
presented secret itself is never logged. Chunked request bodies (git's large pushes, kandev's
endpoint) are decoded before ``git http-backend`` reads them.
"""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

_MAX_BODY = 256 * 1024 * 1024


class GitStandin:
    """The server (a daemon thread in the test process); ``close`` stops it."""

    def __init__(self, root: Path, token: str) -> None:
        self.root = root
        self.token = token
        self.requests: list[str] = []
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (http.server's name)
                pass

            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                standin._serve(self, b"")

            def do_POST(self) -> None:  # noqa: N802
                standin._serve(self, _read_body(self))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="git-standin", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bare_repo(self, owner: str, name: str) -> Path:
        """Create ``<root>/<owner>/<name>.git`` (one commit on ``main``, HEAD -> main)."""
        path = self.root / owner / f"{name}.git"
        path.parent.mkdir(parents=True, exist_ok=True)
        git = ["git", "-c", "init.defaultBranch=main"]
        subprocess.run([*git, "init", "-q", "--bare", str(path)], check=True, timeout=30)
        seed = self.root / f".seed-{owner}-{name}"
        subprocess.run([*git, "init", "-q", str(seed)], check=True, timeout=30)
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@e")
        (seed / "README").write_text(f"{owner}/{name}\n")
        subprocess.run(["git", "-C", str(seed), "add", "README"], check=True, timeout=30, env=env)
        subprocess.run(["git", "-C", str(seed), "commit", "-q", "-m", "first"], check=True, timeout=30, env=env)
        subprocess.run(["git", "-C", str(seed), "push", "-q", str(path), "HEAD:refs/heads/main"], check=True,
                       timeout=30, env=env)
        return path

    def log_lines(self) -> list[str]:
        with self._lock:
            return list(self.requests)

    # ------------------------------------------------------------ one request

    def _auth(self, header: str | None) -> str:
        if not header or not header.startswith("Basic "):
            return "missing"
        try:
            _user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except ValueError:
            return "wrong"
        return "token" if password == self.token else "wrong"

    def _log(self, line: str) -> None:
        with self._lock:
            self.requests.append(line)
            with open(self.root / "requests.log", "a") as f:
                f.write(line + "\n")

    def _serve(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        parts = urlsplit(h.path)
        auth = self._auth(h.headers.get("Authorization"))
        if auth != "token":
            self._log(f"{h.command} {parts.path} auth={auth} status=401")
            _answer(h, 401, {"WWW-Authenticate": 'Basic realm="GitHub"', "Content-Type": "text/plain"},
                    b"authentication required\n")
            return
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": h.command,
            "PATH_INFO": parts.path,
            "QUERY_STRING": parts.query,
            "CONTENT_TYPE": h.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": "x-access-token",  # an authenticated user: http-backend allows receive-pack
            "REMOTE_ADDR": "127.0.0.1",
        }
        if h.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = h.headers["Git-Protocol"]
        proc = subprocess.run(["git", "http-backend"], input=body, capture_output=True, env=env, timeout=120)
        head, _, payload = proc.stdout.partition(b"\r\n\r\n")
        status, headers = 200, {}
        for line in head.decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers[name.strip()] = value.strip()
        if proc.returncode != 0 and not head:
            status, payload = 500, proc.stderr
        self._log(f"{h.command} {parts.path} auth=token status={status}")
        _answer(h, status, headers, payload)


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks, total = [], 0
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            total += size
            if total > _MAX_BODY:
                raise ValueError("request body too large")
            chunks.append(h.rfile.read(size))
            h.rfile.readline()
    return h.rfile.read(int(h.headers.get("Content-Length") or 0))


def _answer(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], payload: bytes) -> None:
    h.send_response(status)
    for name, value in headers.items():
        if name.lower() not in ("content-length", "transfer-encoding", "connection"):
            h.send_header(name, value)
    h.send_header("Content-Length", str(len(payload)))
    h.end_headers()
    h.wfile.write(payload)
