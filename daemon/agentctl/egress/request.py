"""The head of one request an agent sends its egress proxy, read and checked (no socket here).

Two forms are accepted, as every HTTP client sends them to a proxy (RFC 9110, 9112):

- ``CONNECT host:port HTTP/1.1`` (HTTPS and any other TLS): the proxy answers 200 and then copies
  bytes both ways, seeing nothing of what is inside;
- ``GET http://host[:port]/path HTTP/1.1`` (plain HTTP, any method): the request is sent on in
  origin form (``GET /path``), without the proxy's own headers, with ``Connection: close``, so one
  connection carries one request to one destination (a client's next request on it would
  otherwise reach that destination without being judged).

Anything else (an origin-form request, ``https://`` in absolute form, a head over ``MAX_HEAD``
bytes, a malformed line) is a ``BadRequest``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD = 16 * 1024
_HOST = re.compile(r"^[A-Za-z0-9._-]{1,253}$")
_IPV6 = re.compile(r"^[0-9A-Fa-f:.]{2,45}$")
_HOP_HEADERS = frozenset({b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"})


class BadRequest(ValueError):
    """The head cannot be proxied; the message says why (it goes into the 400 answer)."""


@dataclass(frozen=True)
class Request:
    """Where one request goes and, for plain HTTP, the head to send there."""

    connect: bool  # a CONNECT tunnel
    host: str  # as the client wrote it, without brackets
    port: int
    head: bytes = b""  # plain HTTP: the rewritten head, ending with the blank line


def _checked_host(host: str) -> str:
    """A host name (letters, digits, ``.``, ``-``, ``_``) or an IP address; BadRequest otherwise."""
    if _HOST.match(host) or (":" in host and _IPV6.match(host)):
        return host
    raise BadRequest(f"bad host {host!r:.100}")


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port); BadRequest when it is not one."""
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = authority[1:end], authority[end + 1:]
        if end < 0 or (rest and not rest.startswith(":")):
            raise BadRequest(f"bad authority {authority!r:.100}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = authority.partition(":")
    if not port_text:
        if default_port is None:
            raise BadRequest(f"CONNECT needs host:port, got {authority!r:.100}")
        return _checked_host(host), default_port
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise BadRequest(f"bad port in {authority!r:.100}")
    if not host:
        raise BadRequest(f"no host in {authority!r:.100}")
    return _checked_host(host), int(port_text)


def parse(head: bytes) -> Request:
    """The request whose head (request line and headers, up to and including the blank line) is
    ``head``; BadRequest when it cannot be proxied."""
    lines = head.split(b"\r\n")
    try:
        method, target, version = lines[0].decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(f"unsupported protocol {version!r:.20}")
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return Request(True, host, port)
    url = urlsplit(target)
    if url.scheme != "http" or not url.netloc:
        raise BadRequest(
            "only absolute http:// URLs and CONNECT are proxied (https goes through CONNECT)"
            if url.scheme != "https" else "send https:// requests through CONNECT")
    if "@" in url.netloc:
        raise BadRequest("a user in the URL is not accepted")
    host, port = _split_authority(url.netloc, 80)
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    out = [f"{method} {path} {version}".encode("ascii")]
    for line in lines[1:]:
        if not line:
            continue
        name, sep, _ = line.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest("malformed header line")
        if name.lower() not in _HOP_HEADERS:
            out.append(line)
    out.append(b"Connection: close")
    return Request(False, host, port, b"\r\n".join(out) + b"\r\n\r\n")


def close_connection(head: bytes) -> bytes:
    """An answer's head with ``Connection: close`` in place of the hop-by-hop headers."""
    lines = [line for line in head.split(b"\r\n") if line]
    kept = [lines[0], *(line for line in lines[1:] if line.partition(b":")[0].strip().lower() not in _HOP_HEADERS)]
    return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"
