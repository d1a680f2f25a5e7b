"""git's own protocol as the git endpoint reads it from an agent (daemon/backend/git/endpoint.py): the
one-line JSON request header ``daemon.git_transport`` sends first, pkt-lines (buffered reads with
size limits, ``ERR`` packets) and receive-pack's ref-update commands. ``Refused`` is what every part
of the endpoint raises for a request it will not carry; its message goes to git and the journal.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

SERVICES = ("git-upload-pack", "git-receive-pack")
CHUNK = 64 * 1024


class Refused(Exception):
    """A request this endpoint will not carry; ``message`` goes to git and the journal."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def pkt(data: bytes) -> bytes:
    return b"%04x" % (len(data) + 4) + data


def err_pkt(message: str) -> bytes:
    return pkt(b"ERR " + message.encode("utf-8", "replace")[:60000])


class ClientStream:
    """Buffered reads of git's protocol from the agent's socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.eof = False

    def _fill(self) -> bool:
        if self.eof:
            return False
        data = self.sock.recv(CHUNK)
        if not data:
            self.eof = True
            return False
        self._buf += data
        return True

    def line(self, limit: int) -> bytes | None:
        """One ``\\n``-terminated line (without it), None at end of input."""
        while b"\n" not in self._buf:
            if len(self._buf) > limit:
                raise Refused("malformed", "request header too long")
            if not self._fill():
                return None
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._fill():
                raise Refused("malformed", "the connection ended inside a packet")
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def packet(self) -> bytes | None:
        """One pkt-line, raw (length prefix included); None at a clean end of input."""
        if not self._buf and not self._fill():
            return None
        head = self.exact(4)
        try:
            size = int(head, 16)
        except ValueError:
            raise Refused("malformed", "not a git packet") from None
        if size in (0, 1, 2):
            return head
        if size < 4:
            raise Refused("malformed", "not a git packet")
        return head + self.exact(size - 4)

    def section(self, limit: int) -> bytes | None:
        """Packets up to and including a flush; None at end of input before any."""
        out: list[bytes] = []
        total = 0
        while True:
            p = self.packet()
            if p is None:
                if out:
                    raise Refused("malformed", "the connection ended inside a request")
                return None
            out.append(p)
            total += len(p)
            if total > limit:
                raise Refused("too_large", "request too large")
            if p == b"0000":
                return b"".join(out)

    def rest(self) -> Iterator[bytes]:
        """Everything until the agent's git closes its side (the pack of a push)."""
        if self._buf:
            data, self._buf = self._buf, b""
            yield data
        while not self.eof:
            data = self.sock.recv(CHUNK)
            if not data:
                self.eof = True
                return
            yield data


def payloads(section: bytes) -> list[bytes]:
    """The data packets of a flush-terminated section, each without its length prefix."""
    out, i = [], 0
    while i < len(section):
        size = int(section[i:i + 4], 16)
        if size < 4:
            i += 4
            continue
        out.append(section[i + 4:i + size])
        i += size
    return out


@dataclass(frozen=True)
class Header:
    service: str
    host: str
    path: str
    lease_token: str

    @classmethod
    def parse(cls, line: bytes | None) -> Header:
        if line is None:
            raise Refused("malformed", "no request header")
        try:
            doc = json.loads(line)
        except ValueError:
            raise Refused("malformed", "the request header is not JSON") from None
        if not isinstance(doc, dict) or doc.get("v") != 1:
            raise Refused("malformed", "the request header is not version 1")
        fields = {k: doc.get(k) for k in ("service", "host", "path", "lease_token")}
        if not all(isinstance(v, str) and v and len(v) <= 4096 for v in fields.values()):
            raise Refused("malformed", "the request header needs service, host, path and lease_token")
        if fields["service"] not in SERVICES:
            raise Refused("service", f"service {fields['service']!r:.40} is not carried (fetch, clone and push only)")
        return cls(**fields)  # type: ignore[arg-type]


def parse_commands(section: bytes) -> tuple[list[tuple[str, str, str]], set[str]]:
    """receive-pack's ``<old> <new> <ref>`` commands (the first with the client's capabilities
    after a NUL); a shallow line or anything else is refused as malformed."""
    updates: list[tuple[str, str, str]] = []
    caps: set[str] = set()
    for i, payload in enumerate(payloads(section)):
        text = payload.rstrip(b"\n")
        if i == 0 and b"\0" in text:
            text, _, cap_bytes = text.partition(b"\0")
            caps = set(cap_bytes.decode("ascii", "replace").split())
        parts = text.decode("utf-8", "replace").split(" ")
        if len(parts) != 3 or not parts[2].startswith("refs/") or any(len(p) not in (40, 64) for p in parts[:2]):
            raise Refused("malformed", "not a ref-update command")
        updates.append((parts[0], parts[1], parts[2]))
    return updates, caps
