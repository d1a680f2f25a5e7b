"""The blocking client, for the CLI: one request at a time on a plain socket.

``SyncClient`` connects (a missing or dead socket is ``IpcError(unavailable)``
naming the path; ``json=True`` speaks ``ipc.codec_json`` instead of msgpack, to a server that
accepts it: the kandev CLI does, and never loads msgpack), checks the server's major version with
``hello``, and then ``call`` sends a request and waits for the response with the same id,
skipping late replies to earlier timed-out calls. Input is read through a
``FrameBuffer``, so a timeout in the middle of a reply loses nothing and
the connection stays usable. It is not thread-safe.
"""

from __future__ import annotations

import _socket  # socket.py's wrapper adds enums (~4 ms of a CLI call) and nothing this client uses
import os
import time

from .errors import ErrorCode, IpcError, RequestNotSent
from .framing import MAX_FRAME, ConnectionClosed, FrameBuffer
from .hello import HELLO, check_hello

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

__all__ = ["SyncClient"]

_UNSET: Any = object()


_CONNECT_RETRY_S = 0.01


def _connect(sock: _socket.socket, path: str, timeout: float) -> None:
    """Connect, waiting while the server's accept queue is full (a Unix socket with a timeout
    fails at once with EAGAIN then, where a TCP one would wait), up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the accept queue of {path} stayed full") from None
            time.sleep(_CONNECT_RETRY_S)


class SyncClient:
    """A blocking connection to an ``IpcServer``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        protocol_major: int = 1,
        timeout: float = 5.0,
        hello: bool = True,
        json: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.protocol_major = protocol_major
        self.server_hello: dict[str, Any] | None = None
        self._next_id = 1
        self._failure: IpcError | None = None
        self._timeout: Any = _UNSET
        if json:  # the server must accept it (IpcServer(accept_json=True)); it may refuse in msgpack
            from . import codec_json

            self._encode_frame, decode = codec_json.encode_frame, codec_json.decode_reply_body
        else:
            from . import codec_msgpack

            self._encode_frame, decode = codec_msgpack.encode_frame, codec_msgpack.decode_body
        self._frames = FrameBuffer(MAX_FRAME, initial=16 * 1024, decode=decode)
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            _connect(sock, self.path, timeout)
        except TimeoutError:
            sock.close()
            raise IpcError(ErrorCode.UNAVAILABLE, f"timed out connecting to {self.path}") from None
        except OSError as exc:
            sock.close()
            raise IpcError(
                ErrorCode.UNAVAILABLE, f"cannot connect to {self.path}: {exc.strerror or exc}"
            ) from None
        self._sock: _socket.socket | None = sock
        self._timeout = timeout
        if hello:
            try:
                result = self.call(HELLO, {"v": protocol_major}, timeout=timeout)
                self.server_hello = check_hello(result, protocol_major, self.path)
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._sock is None

    def close(self) -> None:
        """Close the connection. Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._failure is None:
            self._failure = IpcError(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the client")

    def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """Send one request and return its result; raise ``IpcError`` on an error response.

        ``timeout`` in seconds; ``None`` waits forever.
        """
        sock = self._sock
        if sock is None:
            assert self._failure is not None
            raise IpcError(self._failure.code, self._failure.message, self._failure.retryable)
        rid = self._next_id
        self._next_id += 1
        data = self._encode_frame(
            {"v": self.protocol_major, "id": rid, "op": op, "args": {} if args is None else args}
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        if timeout != self._timeout:
            self._set_timeout(sock, timeout)
        try:
            sock.sendall(data)
        except TimeoutError:
            raise self._broken(ErrorCode.TIMEOUT, f"{op} on {self.path}: send timed out") from None
        except OSError as exc:
            refusal = self._refusal_after_send_error()
            if refusal is not None:
                raise self._broken_with(refusal) from None
            raise self._broken_with(RequestNotSent(f"connection to {self.path} lost: {exc}")) from None
        while True:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise IpcError(ErrorCode.TIMEOUT, f"{op} on {self.path}: no reply within {timeout} s")
                self._set_timeout(sock, remaining)
            try:
                frame = self._read_frame(sock)
            except TimeoutError:  # partial input stays buffered: the connection stays usable
                raise IpcError(
                    ErrorCode.TIMEOUT, f"{op} on {self.path}: no reply within {timeout} s"
                ) from None
            except ConnectionClosed as exc:
                raise self._broken(
                    ErrorCode.UNAVAILABLE, f"connection to {self.path} lost: {exc.message}"
                ) from None
            except IpcError as exc:  # too large or undecodable: maybe our reply, lost
                raise self._broken_with(exc) from None
            if frame is None:
                raise self._broken(ErrorCode.UNAVAILABLE, f"connection to {self.path} closed by the server")
            frid = frame.get("id")
            if frid is None and frame.get("ok") is False:  # connection-level refusal
                raise self._broken_with(IpcError.from_wire(frame.get("error")))
            if frid != rid:
                continue  # a late reply to an earlier, timed-out call
            if frame.get("ok") is True:
                return frame.get("result")
            raise IpcError.from_wire(frame.get("error"))

    # -- internals ---------------------------------------------------------

    def _read_frame(self, sock: _socket.socket) -> dict[str, Any] | None:
        """The next frame (None at a clean EOF); ``TimeoutError`` propagates."""
        frames = self._frames
        while True:
            frame = frames.next_frame()
            if frame is not None:
                return frame
            try:
                n = sock.recv_into(frames.get_buffer())
            except TimeoutError:
                raise
            except OSError as exc:
                raise ConnectionClosed(str(exc)) from None
            if n == 0:
                if frames.pending:
                    raise ConnectionClosed(
                        f"connection closed in the middle of a frame ({frames.pending} bytes)"
                    )
                return None
            frames.buffer_updated(n)

    def _set_timeout(self, sock: _socket.socket, timeout: float | None) -> None:
        if timeout != self._timeout:  # settimeout costs a syscall; skip when unchanged
            sock.settimeout(timeout)
            self._timeout = timeout

    def _broken(self, code: str, message: str) -> IpcError:
        return self._broken_with(IpcError(code, message))

    def _broken_with(self, error: IpcError) -> IpcError:
        """Drop the connection; later calls fail with ``unavailable``."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._failure = IpcError(
            ErrorCode.UNAVAILABLE, f"connection to {self.path} is closed after: {error.message}"
        )
        return error

    def _refusal_after_send_error(self) -> IpcError | None:
        """After a failed send, read the error frame a refusing server may have left."""
        sock = self._sock
        if sock is None:
            return None
        try:
            self._set_timeout(sock, 0.5)
            frame = self._read_frame(sock)
        except (IpcError, OSError):
            return None
        if frame is not None and frame.get("id") is None and frame.get("ok") is False:
            return IpcError.from_wire(frame.get("error"))
        return None
