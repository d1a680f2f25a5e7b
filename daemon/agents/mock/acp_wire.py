"""The agent side of an ACP conversation on the wire, for the mock agent: JSON-RPC 2.0 over
newline-delimited stdio, with plain dicts (the protocol's own camelCase names) in and out.

The mock agent starts once per session start, resume and restart. Built on the ACP SDK, each
start spent ~0.5 s of CPU, most of it importing the SDK (some 270 pydantic models); without it
~0.2 s. Mock starts were the largest single share of the test suite's CPU. This module does
the little the mock needs by hand, with the
SDK's wire behaviour (tests/unit/test_acp_wire.py; tests/integration/test_mock_agent.py drives
the mock through the SDK's client side, which validates every message with its models):

- every request is handled in its own task, so a ``session/cancel`` notification reaches a
  running ``session/prompt``; a notification nobody handles is dropped;
- a handler's result is the response's ``result``; an ``RpcError`` becomes its ``error``; any
  other exception an ``Internal error`` (-32603) with ``{"details": str(exc)}``; an unknown
  method ``Method not found`` (-32601) with ``{"method": ...}``;
- requests to the client (``session/request_permission``) are numbered from 0 and their
  answers matched by id; a line that is not JSON is logged and skipped;
- one message per line, compact JSON, written one at a time and drained before the next
  (with the stdout pipe's write buffer at 0, a send returns once its bytes are in the pipe: a
  slow reader holds the agent back, and an exit after a send never loses it);
- end of stdin ends the conversation: requests still running are cancelled, requests to the
  client fail with ``ConnectionError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("kandev.mock.wire")

PROTOCOL_VERSION = 1
"""The ACP protocol version the mock speaks (the SDK's ``acp.PROTOCOL_VERSION``)."""
READ_LIMIT = 50 * 1024 * 1024
"""A line longer than this is still read whole (the SDK's stdio default, 50 MiB)."""

Params = dict[str, Any]
RequestHandler = Callable[[Params], Awaitable[Any]]
NotificationHandler = Callable[[Params], Awaitable[None]]


class RpcError(Exception):
    """A JSON-RPC error answered to the client: ``{"code", "message", "data"}``."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data

    @classmethod
    def invalid_request(cls, data: Any = None) -> RpcError:
        return cls(-32600, "Invalid request", data)

    @classmethod
    def method_not_found(cls, method: str) -> RpcError:
        return cls(-32601, "Method not found", {"method": method})

    @classmethod
    def invalid_params(cls, data: Any = None) -> RpcError:
        return cls(-32602, "Invalid params", data)

    @classmethod
    def internal_error(cls, data: Any = None) -> RpcError:
        return cls(-32603, "Internal error", data)

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self), "data": self.data}


class AgentWire:
    """One conversation over a reader and a writer: dispatches what the client sends to
    ``requests``/``notifications`` (by method name) and sends what the agent says."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        requests: dict[str, RequestHandler],
        notifications: dict[str, NotificationHandler],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._requests = requests
        self._notifications = notifications
        self._send_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 0
        self._closed = False

    async def serve(self) -> None:
        """Until the client closes stdin; then cancel what still runs."""
        try:
            while (line := await self._read_line()) is not None:
                if line.strip():
                    self._dispatch(line)
        finally:
            self._closed = True
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("Connection closed"))
            self._pending.clear()
            for task in list(self._tasks):
                task.cancel()
            for task in list(self._tasks):
                with contextlib.suppress(BaseException):
                    await task

    async def notify(self, method: str, params: Params) -> None:
        await self._send({"jsonrpc": "2.0", "method": method, "params": params})

    async def request(self, method: str, params: Params) -> Any:
        """Send a request to the client and wait for its result (an error answer raises ``RpcError``)."""
        if self._closed:
            raise ConnectionError("Connection closed")
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            return await future
        finally:
            self._pending.pop(request_id, None)

    # -- receiving -------------------------------------------------------------

    async def _read_line(self) -> bytes | None:
        chunks: list[bytes] = []
        while True:
            try:
                chunks.append(await self._reader.readuntil(b"\n"))
                return b"".join(chunks)
            except asyncio.LimitOverrunError as exc:  # longer than the buffer: take what is there, go on
                chunks.append(await self._reader.readexactly(exc.consumed))
            except asyncio.IncompleteReadError as exc:  # end of stdin
                chunks.append(exc.partial)
                rest = b"".join(chunks)
                return rest if rest.strip() else None

    def _dispatch(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            log.exception("Error parsing JSON-RPC message")
            return
        if not isinstance(message, dict):
            log.error("JSON-RPC message is not an object: %.200r", message)
            return
        method = message.get("method")
        if method is None:
            if "id" in message:
                self._answered(message)
            return
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if "id" in message:
            self._spawn(self._answer(message["id"], str(method), params))
        elif (handler := self._notifications.get(str(method))) is not None:
            self._spawn(self._notified(str(method), handler, params))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, request_id: Any, method: str, params: Params) -> None:
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id}
        try:
            handler = self._requests.get(method)
            if handler is None:
                raise RpcError.method_not_found(method)
            reply["result"] = await handler(params)
        except RpcError as exc:
            reply["error"] = exc.to_wire()
        except Exception as exc:
            log.exception("Unhandled error while handling request method=%s", method)
            reply["error"] = RpcError.internal_error({"details": str(exc)}).to_wire()
        await self._send(reply)

    async def _notified(self, method: str, handler: NotificationHandler, params: Params) -> None:
        try:
            await handler(params)
        except Exception:
            log.exception("Unhandled error while handling notification method=%s", method)

    def _answered(self, message: dict[str, Any]) -> None:
        future = self._pending.pop(message["id"], None) if isinstance(message["id"], int) else None
        if future is None or future.done():
            return
        if "error" in message:
            error = message.get("error") or {}
            future.set_exception(RpcError(error.get("code", -32603), error.get("message", "Error"), error.get("data")))
        else:
            future.set_result(message.get("result"))

    # -- sending ---------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8")
        async with self._send_lock:
            self._writer.write(data)
            await self._writer.drain()


async def stdio_wire(
    requests: dict[str, RequestHandler], notifications: dict[str, NotificationHandler]
) -> AgentWire:
    """An ``AgentWire`` on this process's stdin and stdout (stdout's write buffer at 0: see above)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, sys.stdout)
    transport.set_write_buffer_limits(high=0)
    writer = asyncio.StreamWriter(transport, protocol, None, loop)
    return AgentWire(reader, writer, requests, notifications)
