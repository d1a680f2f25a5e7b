"""The upstream of the git endpoint (daemon/backend/git/endpoint.py): ``credentials.github_url`` and one
repository on it, reached over smart HTTP with the upstream token, which is used only on these
requests. A failure to reach it or a refusal becomes ``Refused`` with a message naming the setting
to fix (never the token).
"""

from __future__ import annotations

import base64
import http.client
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from daemon.backend.git.wire import Refused
from daemon.core.version import VERSION

UPSTREAM_CONNECT_TIMEOUT_S = 15.0
UPSTREAM_TIMEOUT_S = 120.0
USER_AGENT = f"git/kandev-{VERSION}"


@dataclass(frozen=True)
class Upstream:
    """``credentials.github_url`` and one repository on it."""

    scheme: str
    host: str
    port: int | None
    base_path: str
    repository: str
    token: str

    def __repr__(self) -> str:
        return f"Upstream({self.scheme}://{self.host}/{self.repository})"

    @classmethod
    def of(cls, github_url: str, repository: str, token: str) -> Upstream:
        u = urlsplit(github_url)
        return cls(u.scheme, u.hostname or "", u.port, u.path.rstrip("/"), repository, token)

    @property
    def display(self) -> str:
        port = f":{self.port}" if self.port else ""
        return f"{self.scheme}://{self.host}{port}{self.base_path}"

    def request(self, method: str, suffix: str, body: bytes | Iterator[bytes] | None = None,
                headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=UPSTREAM_CONNECT_TIMEOUT_S)
        auth = base64.b64encode(f"x-access-token:{self.token}".encode()).decode()
        all_headers = {"Authorization": f"Basic {auth}", "User-Agent": USER_AGENT, **(headers or {})}
        path = f"{self.base_path}/{self.repository}.git/{suffix}"
        try:
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(UPSTREAM_TIMEOUT_S)
            conn.request(method, path, body=body, headers=all_headers)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise Refused("upstream_unreachable",
                          f"cannot reach credentials.github_url {self.display}: {failure_reason(exc)}") from None
        if response.status != 200:
            response.read(4096)
            conn.close()
            raise Refused("upstream_refused", _upstream_refusal(self, response.status))
        return conn, response


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__ if not str(exc) else str(exc)[:200]


def _upstream_refusal(up: Upstream, status: int) -> str:
    where = f"{up.display}/{up.repository}"
    if status in (401, 403):
        return (f"{where} refused the token in credentials.github_token_file (HTTP {status}):"
                " replace the token, or give it access to this repository")
    if status == 404:
        return (f"{where} was not found (HTTP 404): check credentials.github_url, and that the token in"
                " credentials.github_token_file can see the repository")
    return f"{where} answered HTTP {status}"


def strip_service_line(body: bytes) -> bytes:
    """Drop smart HTTP's ``# service=...`` packet and its flush, which git's own protocol lacks."""
    if len(body) >= 4 and body[4:14] == b"# service=":
        size = int(body[:4], 16)
        rest = body[size:]
        return rest[4:] if rest.startswith(b"0000") else rest
    return body
