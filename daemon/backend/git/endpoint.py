"""The per-session git endpoint (Issue 20): an agent's git reaches its own repository through
kandev, and kandev alone holds the upstream token.

Inside the sandbox the agent's git is configured (``daemon.credentials.agent_env``) to rewrite
its GitHub URLs to ``ext::`` commands that run ``daemon.git_transport``: a byte pipe that sends a
one-line JSON header (service, host, repository path, the session's lease token) to this
session's socket ``<home>/sessions/<sid>/endpoint/git-proxy.sock`` and then carries git's own
protocol (pkt-lines, as over ssh) both ways. Everything is checked here, outside the sandbox:

- the lease (signature, revocation, expiry, the session live and this endpoint's own, the
  repository the lease was issued for: ``daemon.credentials.redeem_lease``); the upstream token is
  read only now, used only on the request to ``credentials.github_url``, and never written back;
- the service: ``git-upload-pack`` (fetch, clone: protocol v2, whose requests are stateless and
  map one to one onto smart-HTTP POSTs) or ``git-receive-pack`` (push);
- for a push, every ref-update command against ``credentials.push_refs`` (``ref_allowed``) before
  anything is sent upstream: a refused push never reaches the upstream, and git reports each ref
  as rejected with the reason (``! [remote rejected] main -> main (kandev: ...)``).

Refusals reach git as an ``ERR`` packet (git prints ``fatal: remote error: kandev: ...``) or a
push report, and the journal as ``git_endpoint_refused``; neither ever holds a secret.

git's wire format (the header, pkt-lines, ref-update commands) is read by ``git_wire``; the
upstream over smart HTTP is ``git_upstream``; this module holds the checks, one connection's
exchange and the listeners.

Threads, not the event loop: each listening socket has an accept thread; each connection runs in
a bounded pool (``MAX_WORKERS``), at most ``MAX_CONNECTIONS_PER_SESSION`` per session (more are
answered with an ``ERR`` and closed; beyond ``MAX_PENDING_REFUSALS`` waiting for that answer, closed
unanswered); every socket has a timeout, so nothing waits forever.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fnmatch import fnmatchcase
from pathlib import Path

from daemon.backend.git.upstream import Upstream, failure_reason, strip_service_line
from daemon.backend.git.wire import (
    CHUNK,
    ClientStream,
    Header,
    Refused,
    err_pkt,
    parse_commands,
    payloads,
    pkt,
)
from daemon.config.settings import CredentialsConfig
from daemon.core.journal import log_event
from daemon.credentials import CredentialError, ScopeDenied, redeem_lease
from daemon.credentials.signing import lease_claims_unverified
from daemon.store.db import Store

log = logging.getLogger(__name__)

MAX_WORKERS = 32
MAX_CONNECTIONS_PER_SESSION = 8
MAX_PENDING_REFUSALS = 256
MAX_HEADER = 16 * 1024
MAX_REQUEST = 32 * 1024 * 1024  # one upload-pack request (wants and haves)
MAX_ADVERTISEMENT = 64 * 1024 * 1024
CLIENT_TIMEOUT_S = 120.0
DRAIN_TIMEOUT_S = 2.0
DRAIN_LIMIT = 4 * 1024 * 1024
ZERO_OID = "0" * 40
DEFAULT_BRANCH = "@default"


def ref_allowed(ref: str, patterns: tuple[str, ...], default_ref: str | None) -> bool:
    """``credentials.push_refs``: the last pattern matching ``ref`` decides (gitignore-like); a
    ``!`` pattern refuses; ``@default`` is the repository's default branch (what the upstream's
    HEAD names). ``*`` matches across ``/``. No pattern matching: refused."""
    allowed = False
    for pattern in patterns:
        negative = pattern.startswith("!")
        glob = pattern[1:] if negative else pattern
        matched = (ref == default_ref) if glob == DEFAULT_BRANCH else fnmatchcase(ref, glob)
        if matched:
            allowed = not negative
    return allowed


# ---------------------------------------------------------------- one connection


class Connection:
    """One git command's connection, handled start to end in a worker thread."""

    def __init__(self, proxy: GitProxy, session_id: str, sock: socket.socket) -> None:
        self.proxy = proxy
        self.session_id = session_id
        self.sock = sock
        self.stream = ClientStream(sock)
        self.repository: str | None = None
        self.service: str | None = None

    def run(self) -> None:
        try:
            self.sock.settimeout(CLIENT_TIMEOUT_S)
            self._serve()
        except Refused as exc:
            self._refuse(exc)
        except (OSError, http.client.HTTPException) as exc:
            log.info("session %s: git connection ended: %s", self.session_id, failure_reason(exc))
        except Exception:  # never a traceback that could quote a request
            log.error("session %s: git endpoint internal error", self.session_id, exc_info=False)
            self._send(err_pkt("kandev: internal error in the git endpoint (see the backend's journal)"))
        finally:
            try:
                self.sock.close()
            except OSError:
                pass

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            pass

    def _refuse(self, exc: Refused) -> None:
        log_event("git_endpoint_refused", f"session {self.session_id}: git {self.service or 'request'} refused:"
                  f" {exc.reason}: {exc.message}", priority=4, SESSION_ID=self.session_id,
                  REPOSITORY=self.repository, SERVICE=self.service, REASON=exc.reason)
        self._send(err_pkt(f"kandev: {exc.message}"))
        self._drain()

    def refuse_busy(self) -> None:
        try:
            self.sock.settimeout(DRAIN_TIMEOUT_S)
            self._refuse(Refused("busy", f"more than {MAX_CONNECTIONS_PER_SESSION} git connections of this"
                                 " session at once; try again"))
        finally:
            self.sock.close()

    def _drain(self) -> None:
        """After a refusal: end our side and read (briefly, boundedly) what git still sends, so the
        close is not a reset that would lose the ERR packet before git reads it."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(DRAIN_TIMEOUT_S)
            total = 0
            while total < DRAIN_LIMIT and (data := self.sock.recv(CHUNK)):
                total += len(data)
        except OSError:
            pass

    def _serve(self) -> None:
        header = Header.parse(self.stream.line(MAX_HEADER))
        self.service = header.service
        try:
            claims = lease_claims_unverified(header.lease_token)
            if claims.session_id != self.session_id:
                raise ScopeDenied(f"this endpoint serves session {self.session_id} only")
            with self.proxy.store.session() as db:
                r = redeem_lease(db, header.lease_token, header.host, header.path, config=self.proxy.config)
        except CredentialError as exc:
            raise Refused(str(exc.code), f"{exc.code}: {exc.message}") from None
        self.repository = f"{r.host}/{r.repository}"
        upstream = Upstream.of(self.proxy.config.github_url, r.repository, r.password)
        if header.service == "git-upload-pack":
            self._upload_pack(upstream)
        else:
            self._receive_pack(upstream)

    # ------------------------------------------------------------ fetch and clone (protocol v2)

    def _upload_pack(self, up: Upstream) -> None:
        v2 = {"Git-Protocol": "version=2"}
        conn, resp = up.request("GET", "info/refs?service=git-upload-pack", headers=v2)
        try:
            advertisement = strip_service_line(resp.read(MAX_ADVERTISEMENT))
        finally:
            conn.close()
        if not advertisement.startswith(pkt(b"version 2\n")):
            raise Refused("upstream_protocol", f"{up.display} does not speak git protocol v2")
        self.sock.sendall(advertisement)
        while True:
            request = self.stream.section(MAX_REQUEST)
            if request is None or request == b"0000":
                return  # git is done
            command = payloads(request)[:1]
            if command not in ([b"command=ls-refs\n"], [b"command=fetch\n"], [b"command=ls-refs"],
                               [b"command=fetch"]):
                raise Refused("service", "only ls-refs and fetch are carried")
            conn, resp = up.request("POST", "git-upload-pack", body=request, headers={
                **v2, "Content-Type": "application/x-git-upload-pack-request",
                "Accept": "application/x-git-upload-pack-result"})
            try:
                while chunk := resp.read(CHUNK):
                    self.sock.sendall(chunk)
            finally:
                conn.close()

    # ------------------------------------------------------------ push

    def _receive_pack(self, up: Upstream) -> None:
        conn, resp = up.request("GET", "info/refs?service=git-receive-pack")
        try:
            advertisement = strip_service_line(resp.read(MAX_ADVERTISEMENT))
        finally:
            conn.close()
        self.sock.sendall(advertisement)
        commands = self.stream.section(MAX_REQUEST)
        if commands is None or commands == b"0000":
            return  # nothing to push
        updates, caps = parse_commands(commands)
        patterns = self.proxy.config.push_refs
        default_ref = self._default_branch(up) if any(p.lstrip("!") == DEFAULT_BRANCH for p in patterns) else None
        refused = [ref for _old, _new, ref in updates if not ref_allowed(ref, patterns, default_ref)]
        sends_pack = any(new != ZERO_OID for _old, new, _ref in updates)
        if refused:
            self._refuse_push(updates, refused, caps, sends_pack)
            return
        head = commands
        if "push-options" in caps:
            options = self.stream.section(MAX_REQUEST)
            head += options or b""

        def body() -> Iterator[bytes]:
            yield head
            if sends_pack:
                yield from self.stream.rest()

        conn, resp = up.request("POST", "git-receive-pack", body=body(), headers={
            "Content-Type": "application/x-git-receive-pack-request",
            "Accept": "application/x-git-receive-pack-result"})
        try:
            while chunk := resp.read(CHUNK):
                self.sock.sendall(chunk)
        finally:
            conn.close()
        log_event("git_endpoint_push", f"session {self.session_id}: pushed {', '.join(r for *_, r in updates)}"
                  f" to {self.repository}", SESSION_ID=self.session_id, REPOSITORY=self.repository,
                  REFS=" ".join(r for *_, r in updates))

    def _default_branch(self, up: Upstream) -> str | None:
        """The ref the upstream's HEAD names (protocol v0 advertises it as ``symref=HEAD:<ref>``)."""
        conn, resp = up.request("GET", "info/refs?service=git-upload-pack")
        try:
            first = payloads(strip_service_line(resp.read(MAX_ADVERTISEMENT)))[:1]
        finally:
            conn.close()
        if not first or b"\0" not in first[0]:
            return None
        for cap in first[0].split(b"\0", 1)[1].split():
            if cap.startswith(b"symref=HEAD:"):
                return cap[len(b"symref=HEAD:"):].decode("utf-8", "replace")
        return None

    def _refuse_push(self, updates: list[tuple[str, str, str]], refused: list[str], caps: set[str],
                     sends_pack: bool) -> None:
        """Answer the push ourselves: every ref rejected (nothing is sent upstream), the reason
        named; the pack git sends is read and dropped so git reads the report instead of a broken pipe."""
        patterns = " ".join(self.proxy.config.push_refs)
        reason = f"kandev: refused by credentials.push_refs ({patterns})"
        log_event("git_endpoint_refused", f"session {self.session_id}: push to {self.repository} refused:"
                  f" {', '.join(refused)} not allowed by credentials.push_refs", priority=4,
                  SESSION_ID=self.session_id, REPOSITORY=self.repository, SERVICE=self.service,
                  REASON="push_refs", REFS=" ".join(refused))
        if sends_pack:
            for _ in self.stream.rest():
                pass
        if not caps & {"report-status", "report-status-v2"}:
            self._send(err_pkt(f"{reason}: {', '.join(refused)}"))
            return
        report = [pkt(b"unpack ok\n")]
        for _old, _new, ref in updates:
            why = reason if ref in refused else "kandev: not pushed, another ref of this push was refused"
            report.append(pkt(f"ng {ref} {why}\n".encode()))
        report.append(b"0000")
        data = b"".join(report)
        if "side-band-64k" in caps or "side-band" in caps:
            size = 65515 if "side-band-64k" in caps else 995
            msg = pkt(b"\x02" + f"{reason}: {', '.join(refused)}\n".encode())
            bands = [msg] + [pkt(b"\x01" + data[i:i + size]) for i in range(0, len(data), size)]
            data = b"".join(bands) + b"0000"
        self._send(data)


# ---------------------------------------------------------------- the listeners


class _Listener:
    def __init__(self, session_id: str, path: Path, sock: socket.socket) -> None:
        self.session_id = session_id
        self.path = path
        self.sock = sock
        self.active: set[socket.socket] = set()
        self.refusing = 0
        self.lock = threading.Lock()
        self.closed = False
        self.thread: threading.Thread | None = None


class GitProxy:
    """The git endpoints of this backend, one listening socket per session."""

    def __init__(self, store: Store, config: CredentialsConfig) -> None:
        self.store = store
        self.config = config
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(MAX_WORKERS, thread_name_prefix="git-endpoint")
            return self._pool

    def is_open(self, session_id: str) -> bool:
        return session_id in self._listeners

    def open(self, session_id: str, path: Path) -> None:
        """Listen on ``path`` (0600; a stale socket there is replaced) for ``session_id``. Blocking."""
        with self._lock:
            if session_id in self._listeners:
                return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                sock.bind(os.fspath(path))
            finally:
                os.umask(old)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        listener = _Listener(session_id, path, sock)
        listener.thread = threading.Thread(target=self._accept, args=(listener,), name=f"git-endpoint-{session_id}",
                                           daemon=True)
        with self._lock:
            self._listeners[session_id] = listener
        listener.thread.start()

    def close(self, session_id: str) -> None:
        """Stop listening and end the session's open connections. Blocking (briefly)."""
        with self._lock:
            listener = self._listeners.pop(session_id, None)
        if listener is None:
            return
        with listener.lock:
            listener.closed = True
            active = list(listener.active)
        for s in (listener.sock, *active):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        listener.sock.close()
        if listener.thread is not None:
            listener.thread.join(timeout=5)
        try:
            os.unlink(listener.path)
        except OSError:
            pass

    def close_all(self) -> None:
        for sid in list(self._listeners):
            self.close(sid)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self, listener: _Listener) -> None:
        while True:
            try:
                conn, _ = listener.sock.accept()
            except OSError:
                return  # closed
            with listener.lock:
                if listener.closed:
                    conn.close()
                    return
                busy = len(listener.active) >= MAX_CONNECTIONS_PER_SESSION
                if not busy:
                    listener.active.add(conn)
                elif listener.refusing >= MAX_PENDING_REFUSALS:
                    conn.close()  # a flood: not even an answer
                    continue
                else:
                    listener.refusing += 1
            try:
                self._executor().submit(self._run, listener, conn, busy)
            except RuntimeError:  # shutting down
                with listener.lock:
                    listener.active.discard(conn)
                conn.close()

    def _run(self, listener: _Listener, conn: socket.socket, busy: bool) -> None:
        connection = Connection(self, listener.session_id, conn)
        if busy:  # answered at once, never served
            try:
                connection.refuse_busy()
            finally:
                with listener.lock:
                    listener.refusing -= 1
            return
        try:
            connection.run()
        finally:
            with listener.lock:
                listener.active.discard(conn)
