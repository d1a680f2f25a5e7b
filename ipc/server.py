"""An asyncio request/response server for one ``OpTable`` on a Unix socket.

The server owns the protocol mechanics so that a daemon only writes
handlers: peer admission by ``SO_PEERCRED`` before any frame is read, the
request envelope ``{v, id, op, args}``, the built-in ``hello``, argument
validation against the table, the ``authorize`` hook, concurrent dispatch
(one task per request that may wait, bounded per connection) with
out-of-order responses, typed error responses, and stream ops. A bad frame
or a failing handler costs at most that request (or, when the stream cannot
be resynchronised, that connection); never the server.

Handlers are ``async def handler(ctx, args) -> result``, or a plain
``def handler(ctx, args) -> result`` for an answer that needs no waiting (a
read of in-memory state, a flag set, a task started): the server calls a plain
handler as soon as its request is read and writes the response at once, with
no task in between (a task per request was a fifth of a round trip). Stream
handlers are always ``async``. When the peer goes away, ordinary handlers
still run to completion (their response is dropped), while a stream handler
is cancelled. ``close()`` cancels all.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Collection, Mapping
from functools import partial
from typing import Any

from ipc.aio import within

from . import codec_msgpack
from .connection import ConnectionContext
from .errors import ErrorCode, IpcError
from .framing import MAX_FRAME, BufferBudget, ConnectionClosed, FrameTooLarge
from .hello import HELLO
from .listener import LISTEN_BACKLOG, SocketIdentity, bind_listener, check_socket_path, unlink_if_ours
from .peercred import peer_admitted, peer_credentials
from .schema import Op, OpTable
from .server_protocol import REFUSAL_LINGER_S, ConnectionLimits, ServerProtocol, error_frame

__all__ = ["HELLO", "AsyncHandler", "Authorize", "ConnectionContext", "Handler", "IpcServer", "PlainHandler"]

log = logging.getLogger(__name__)

AsyncHandler = Callable[[ConnectionContext, dict[str, Any]], Awaitable[Any]]
PlainHandler = Callable[[ConnectionContext, dict[str, Any]], Any]
Handler = AsyncHandler | PlainHandler
"""An op's handler: ``async def`` (it runs in a task of its own) or plain ``def`` (called inline)."""
Authorize = Callable[[ConnectionContext, Op], None]

HELLO_OP = Op(HELLO, optional={"v": int, "client": str}, auth=False)  # the built-in op every server answers
_CLOSE_GRACE = 1.0  # seconds close() lets connections flush before aborting them
_REFUSAL_LINGER_S = REFUSAL_LINGER_S  # seconds a refused connection stays half-open for the peer to read why
BUFFER_LIMIT = 32 * 1024 * 1024
"""Default cap on the receive-buffer bytes of all of a server's connections together."""


def _valid_id(rid: Any) -> bool:
    return (isinstance(rid, int) and not isinstance(rid, bool)) or (isinstance(rid, str) and len(rid) <= 256)


class IpcServer:
    """Serve ``table`` on the Unix socket ``path`` with ``handlers``.

    ``allowed_uids`` defaults to our own uid and root; ``allowed_gids`` also
    admits peers by primary or supplementary group. ``authorize(ctx, op)``
    is called before every ``auth=True`` op and raises ``IpcError`` to
    refuse it. A frame that has begun must be complete within
    ``frame_timeout`` seconds (of time we spend reading), else the
    connection gets ``invalid_frame`` and is closed.

    ``idle_timeout`` (seconds, None: never): a connection with no request in
    flight and no stream that sent nothing for that long is told
    ``idle_timeout`` and closed, unless ``idle_exempt(ctx)`` is true.
    ``accept_json``: a peer whose first frame is a JSON object (``ipc.codec_json``) is answered in
    JSON on that connection; otherwise every frame is msgpack.
    ``buffer_limit``: the receive-buffer bytes all connections may hold
    together; a frame that would pass it is refused with ``buffers_full``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        table: OpTable,
        handlers: Mapping[str, Handler],
        *,
        authorize: Authorize | None = None,
        allowed_uids: Collection[int] | None = None,
        allowed_gids: Collection[int] = (),
        socket_mode: int = 0o600,
        max_frame: int = MAX_FRAME,
        max_connections: int = 256,
        max_inflight_per_connection: int = 64,
        on_disconnect: Callable[[ConnectionContext], None] | None = None,
        frame_timeout: float = 5.0,
        idle_timeout: float | None = None,
        idle_exempt: Callable[[ConnectionContext], bool] | None = None,
        buffer_limit: int = BUFFER_LIMIT,
        accept_json: bool = False,
    ) -> None:
        if HELLO in table or HELLO in handlers:
            raise ValueError("'hello' is built into IpcServer; a table must not redefine it")
        missing = [name for name in table.names if name not in handlers]
        extra = sorted(name for name in handlers if name not in table)
        if missing or extra:
            raise ValueError(
                f"handlers do not match table {table.protocol}: "
                f"missing {missing or 'none'}, not in table {extra or 'none'}"
            )
        if not 0 < max_frame <= MAX_FRAME:
            raise ValueError(f"max_frame must be in 1..{MAX_FRAME}")
        if max_connections < 1 or max_inflight_per_connection < 1:
            raise ValueError("max_connections and max_inflight_per_connection must be >= 1")
        if frame_timeout <= 0:
            raise ValueError("frame_timeout must be > 0")
        if idle_timeout is not None and idle_timeout <= 0:
            raise ValueError("idle_timeout must be > 0 (None: no idle timeout)")
        self.path = check_socket_path(path)
        self.table = table
        self._handlers = dict(handlers)
        # Plain-function handlers, answered inline (see the module doc); a stream op's handler waits
        # for its peer by nature, so it must be a coroutine function.
        self._plain = frozenset(name for name, h in self._handlers.items() if not inspect.iscoroutinefunction(h))
        plain_streams = sorted(name for name in self._plain if table.get(name).stream)
        if plain_streams:
            raise ValueError(f"stream ops need an async handler: {', '.join(plain_streams)}")
        # Each request's task is named after its op (task dumps), with names made once: a task
        # left to name itself formats "Task-<n>" at every request.
        self._task_names = {name: f"ipc.{name}" for name in self._handlers}
        self._authorize = authorize
        self._allowed_uids = frozenset({os.getuid(), 0} if allowed_uids is None else allowed_uids)
        self._allowed_gids = frozenset(allowed_gids)
        self._socket_mode = socket_mode
        self._max_connections = max_connections
        self._on_disconnect = on_disconnect
        self._limits = ConnectionLimits(
            max_frame, max_inflight_per_connection, frame_timeout, idle_timeout, idle_exempt, accept_json
        )
        self._budget = BufferBudget(buffer_limit)
        self._hello_result = {
            "protocol": table.protocol,
            "version": [table.version[0], table.version[1]],
            "capabilities": list(table.capabilities),
            "ops": table.names,
        }
        self._server: asyncio.AbstractServer | None = None
        self._identity: SocketIdentity | None = None
        self._connections: set[ConnectionContext] = set()
        self._lingering: set[asyncio.Transport] = set()  # refused peers reading why (admit)
        self._all_gone = asyncio.Event()
        self._handler_tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._listen_sock: socket.socket | None = None
        self._refusing: IpcError | None = None  # set while quiesced for a hand-over

    # -- lifecycle ---------------------------------------------------------

    @property
    def connections(self) -> set[ConnectionContext]:
        """The live connections (a copy)."""
        return set(self._connections)

    @property
    def buffered(self) -> int:
        """Receive-buffer bytes all connections hold now (charged against ``buffer_limit``)."""
        return self._budget.used

    async def start(self) -> None:
        """Bind the socket (see ``ipc.listener`` for the safety rules) and accept."""
        if self._server is not None:
            raise RuntimeError("server already started")
        sock, self.path, self._identity = bind_listener(self.path, self._socket_mode)
        try:
            await self._serve_on(sock)
        except BaseException:
            sock.close()
            unlink_if_ours(self.path, self._identity)
            raise

    async def _serve_on(self, sock: socket.socket) -> None:
        """Accept on ``sock`` (bound here, or handed over by an earlier process image) with this
        server's limits. asyncio listens on it again with the backlog it is given (100 unless
        told): ``LISTEN_BACKLOG`` keeps the accept queue ``bind_listener`` made, for every socket."""
        loop = asyncio.get_running_loop()
        factory = partial(ServerProtocol, self, self._limits, self._budget)
        self._server = await loop.create_unix_server(factory, sock=sock, backlog=LISTEN_BACKLOG)
        self._listen_sock = sock

    async def close(self, *, keep_socket_file: bool = False) -> None:
        """Stop accepting, close every connection, cancel handlers, remove the socket file (unless
        ``keep_socket_file``: after ``stop_accepting``, when another server goes on serving it)."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        for ctx in list(self._connections):
            ctx.close()
        for transport in list(self._lingering):
            self._end_linger(transport)
        for task in list(self._handler_tasks):
            task.cancel()
        if self._handler_tasks:
            await asyncio.wait(list(self._handler_tasks), timeout=_CLOSE_GRACE)
        if self._connections:
            try:
                await within(self._all_gone.wait(), _CLOSE_GRACE)
            except TimeoutError:  # peers that do not read: drop their unsent frames
                for ctx in list(self._connections):
                    ctx.abort()
                try:
                    await within(self._all_gone.wait(), _CLOSE_GRACE)
                except TimeoutError:
                    log.warning(
                        "ipc server %s: %d connections did not close", self.path, len(self._connections)
                    )
        if self._server is not None:
            await self._server.wait_closed()
        if not keep_socket_file:
            unlink_if_ours(self.path, self._identity)

    async def __aenter__(self) -> IpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- connections (called by ServerProtocol) ------------------------------

    def admit(self, transport: asyncio.Transport) -> ConnectionContext | None:
        """Check a new peer before reading anything; refuse it with one error frame."""
        try:
            creds = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            log.warning("ipc server %s: cannot read peer credentials: %s", self.path, exc)
            transport.abort()
            return None
        if not peer_admitted(creds, self._allowed_uids, self._allowed_gids):
            log.warning(
                "ipc server %s: refused peer pid=%d uid=%d gid=%d", self.path, creds.pid, creds.uid, creds.gid
            )
            error = IpcError(
                ErrorCode.PERMISSION_DENIED,
                f"uid {creds.uid} (gid {creds.gid}) is not admitted on this socket",
            )
        elif self._closing:
            error = IpcError(ErrorCode.SHUTTING_DOWN, "server is shutting down")
        elif len(self._connections) >= self._max_connections:
            error = IpcError(
                ErrorCode.UNAVAILABLE, f"too many connections (limit {self._max_connections})", retryable=True
            )
        else:
            ctx = ConnectionContext(creds, transport)
            self._connections.add(ctx)
            self._all_gone.clear()
            return ctx
        transport.write(error_frame(None, error, codec_msgpack))  # before any frame: every peer reads msgpack
        if transport.can_write_eof():
            # Lingering close: half-close so the peer reads the refusal, then EOF, and keep
            # discarding its input for a moment. A peer that already wrote its first request
            # then gets the typed refusal, not EPIPE/ECONNRESET from our socket vanishing.
            transport.write_eof()
            self._lingering.add(transport)
            asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, self._end_linger, transport)
        else:
            transport.close()
        return None

    def _end_linger(self, transport: asyncio.Transport) -> None:
        self._lingering.discard(transport)
        transport.close()

    def forget(self, ctx: ConnectionContext) -> None:
        """The connection is gone (after ``ctx.closed`` was set)."""
        self._connections.discard(ctx)
        if ctx.stream_task is not None:  # cancelled, maybe before it ran its own cleanup
            ctx.stream_task.add_done_callback(self._handler_tasks.discard)
        if not self._connections:
            self._all_gone.set()
        if self._on_disconnect is not None:
            try:
                self._on_disconnect(ctx)
            except Exception:
                log.exception("ipc server %s: on_disconnect failed", self.path)

    # -- requests ----------------------------------------------------------

    def dispatch(self, conn: ServerProtocol, ctx: ConnectionContext, frame: dict[str, Any]) -> None:
        """Answer a request inline when it can be refused (or is ``hello``), else start its handler."""
        rid = frame.get("id")
        if self._refusing is not None:  # quiesced for a hand-over: never run, so safe to retry
            ctx.send_soon(error_frame(rid if _valid_id(rid) else None, self._refusing, ctx.codec))
            return
        try:
            op, args = self._admit_request(ctx, frame, rid)
        except IpcError as exc:
            ctx.send_soon(error_frame(rid if _valid_id(rid) else None, exc, ctx.codec))
            return
        if op is None:  # hello
            ctx.send_soon(ctx.codec.encode_frame({"id": rid, "ok": True, "result": args}))
            return
        if op.name in self._plain:
            self._answer_now(conn, ctx, op, rid, args)
            return
        conn.inflight += 1
        task = asyncio.get_running_loop().create_task(self._run(conn, ctx, op, rid, args),
                                                      name=self._task_names.get(op.name))
        self._handler_tasks.add(task)
        if op.stream:
            ctx.stream_id = rid
            ctx.stream_task = task

    def _admit_request(
        self, ctx: ConnectionContext, frame: dict[str, Any], rid: Any
    ) -> tuple[Op | None, dict[str, Any]]:
        """Check the envelope, the op, its args and authorization.

        Returns ``(op, args)``, or ``(None, hello_result)`` for ``hello``.
        """
        if not _valid_id(rid):
            raise IpcError(ErrorCode.INVALID_FRAME, "request 'id' missing or not an int or short str")
        name = frame.get("op")
        if not isinstance(name, str):
            raise IpcError(ErrorCode.INVALID_FRAME, "request 'op' missing or not a str")
        v = frame.get("v")
        if not isinstance(v, int) or isinstance(v, bool):
            raise IpcError(ErrorCode.INVALID_FRAME, "request 'v' (protocol major version) missing")
        if v != self.table.major:
            raise self._incompatible(v)
        if name == HELLO:
            args = HELLO_OP.validate(frame.get("args"))
            if "v" in args and args["v"] != self.table.major:
                raise self._incompatible(args["v"])
            return None, self._hello_result
        op = self.table.get(name)
        args = op.validate(frame.get("args"))
        if op.auth and self._authorize is not None:
            try:
                self._authorize(ctx, op)
            except IpcError:
                raise
            except Exception:
                log.exception("ipc server %s: authorize failed for %s", self.path, name)
                raise IpcError(ErrorCode.INTERNAL, "internal error") from None
        return op, args

    def _incompatible(self, v: Any) -> IpcError:
        major, minor = self.table.version
        return IpcError(
            ErrorCode.INCOMPATIBLE_VERSION,
            f"{self.table.protocol} speaks protocol {major}.{minor}; client asked for major {v}",
        )

    def _answer_now(
        self, conn: ServerProtocol, ctx: ConnectionContext, op: Op, rid: Any, args: dict[str, Any]
    ) -> None:
        """Call a plain handler and write its response now. While our writes to the peer are
        paused the connection reads no request at all (``ServerProtocol.process``), so this runs
        only when the peer reads; if another response still holds the write path (an async
        handler's, waiting for the peer), a task writes this one after it, counted in flight like
        a running handler (so a half-closed peer still gets it)."""
        try:
            data = self._result_frame(ctx, op, rid, self._handlers[op.name](ctx, args))
        except IpcError as exc:
            data = error_frame(rid, exc, ctx.codec)
        except Exception:
            data = error_frame(rid, self._internal_error(op), ctx.codec)
        if ctx.closing or ctx.try_send(data):
            return
        conn.inflight += 1
        task = asyncio.get_running_loop().create_task(self._send_late(conn, ctx, data),
                                                      name=self._task_names.get(op.name))
        self._handler_tasks.add(task)

    async def _send_late(self, conn: ServerProtocol, ctx: ConnectionContext, data: bytes) -> None:
        """Write a plain handler's response once the peer reads again (see ``_answer_now``)."""
        try:
            await ctx.send_frame(data)
        except ConnectionClosed:
            pass  # the peer left: nobody to answer
        finally:
            self._handler_tasks.discard(asyncio.current_task())
            conn.task_done()

    def _internal_error(self, op: Op) -> IpcError:
        """Log the handler's exception (being handled) and say only that it failed."""
        log.exception("ipc server %s: handler for %s failed", self.path, op.name)
        return IpcError(ErrorCode.INTERNAL, f"internal error in {op.name}")

    def _result_frame(self, ctx: ConnectionContext, op: Op, rid: Any, result: Any) -> bytes:
        """The encoded ok response, or an error response if the connection's codec cannot carry
        the result."""
        try:
            return ctx.codec.encode_frame({"id": rid, "ok": True, "result": result})
        except IpcError as exc:
            log.error("ipc server %s: result of %s not sendable: %s", self.path, op.name, exc)
            code = exc.code if isinstance(exc, FrameTooLarge) else ErrorCode.INTERNAL
            return error_frame(rid, IpcError(code, f"result of {op.name} not sendable"), ctx.codec)

    async def _run(
        self, conn: ServerProtocol, ctx: ConnectionContext, op: Op, rid: Any, args: dict[str, Any]
    ) -> None:
        try:
            try:
                result = await self._handlers[op.name](ctx, args)
            except IpcError as exc:
                error: IpcError | None = exc
            except Exception:
                error = self._internal_error(op)
            else:
                error = None
            if op.stream and ctx.streaming:
                if error is not None:  # the stream ends with the error, then closes
                    await ctx.send_frame(error_frame(rid, error, ctx.codec))
                return
            data = self._result_frame(ctx, op, rid, result) if error is None else error_frame(rid, error, ctx.codec)
            if not ctx.try_send(data):
                await ctx.send_frame(data)
            elif ctx.write_paused:
                await ctx.settle()
        except ConnectionClosed:
            pass  # the peer left: nobody to answer
        finally:
            if op.stream:
                ctx.close()
            # Bookkeeping here rather than in a done-callback: one loop iteration less per request.
            self._handler_tasks.discard(asyncio.current_task())
            conn.task_done()

    # -- hand-over of the listening socket (the control server's re-exec) -----------------

    async def start_on(self, sock: socket.socket, identity: SocketIdentity | None) -> None:
        """Serve on a listening socket an earlier process image bound and handed over (kept open
        across exec); ``identity`` is its file's, so ``close`` still removes only that file."""
        if self._server is not None:
            raise RuntimeError("server already started")
        sock.setblocking(False)
        self._identity = identity
        await self._serve_on(sock)

    def refuse_new_requests(self, error: IpcError | None) -> None:
        """From now on answer every new request with ``error`` (None: run them again). A request
        refused so never ran: the client may send it again."""
        self._refusing = error

    async def wait_handlers(self, timeout: float) -> bool:
        """Wait until no request handler runs (stream handlers aside); False after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            busy = [t for t in self._handler_tasks if not t.done() and t not in self._stream_tasks()]
            if not busy:
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            await asyncio.wait(busy, timeout=left)

    def _stream_tasks(self) -> set[asyncio.Task[None]]:
        return {c.stream_task for c in self._connections if c.stream_task is not None}

    def stop_accepting(self) -> socket.socket:
        """Stop accepting and return the listening socket, still open (a duplicate of it): peers
        that connect meanwhile wait in its backlog for whoever serves it next."""
        if self._server is None or self._listen_sock is None:
            raise RuntimeError("server not started")
        kept = self._listen_sock.dup()
        self._server.close()  # closes our copy only
        self._server = None
        self._listen_sock = None
        return kept

    async def resume_accepting(self, sock: socket.socket) -> None:
        """Accept again on ``sock`` (from ``stop_accepting``) after a hand-over did not happen."""
        await self._serve_on(sock)

    @property
    def identity(self) -> SocketIdentity | None:
        """(st_dev, st_ino) of the socket file this server bound."""
        return self._identity

    async def close_connections(self, final: IpcError, timeout: float) -> None:
        """Close every connection after what was already written to it, ending with ``final`` (a
        connection-level error frame) so a client's calls still in flight fail with it: they were
        not run. Connections still open after ``timeout`` s are aborted."""
        async def finish(ctx: ConnectionContext) -> None:
            if ctx.streaming or ctx.stream_task is not None:
                ctx.close()  # a stream peer sends nothing: it reads to a frame boundary, then EOF
                return
            try:  # after every frame already queued on this connection
                await within(ctx.send_frame(error_frame(None, final, ctx.codec)), timeout)
            except (ConnectionClosed, TimeoutError):
                pass
            ctx.linger()  # the peer reads the final frame and closes; what it sent meanwhile is dropped

        for transport in list(self._lingering):
            self._end_linger(transport)
        await asyncio.gather(*(finish(ctx) for ctx in list(self._connections)))
        if self._connections:
            try:
                await within(self._all_gone.wait(), timeout)
            except TimeoutError:
                for ctx in list(self._connections):
                    ctx.abort()
