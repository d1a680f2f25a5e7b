"""The tests' own local stand-in of the Anthropic Messages API (Issue 12).

Real agents (Claude Code through ``@zed-industries/claude-code-acp``) are driven end to end through
kandev; the LLM provider is the one boundary the tests cannot reach, so this module plays it on
127.0.0.1, which an agent (in a network namespace of its own) reaches through its egress proxy
once its address is listed in ``[network] host_ports`` (``StandIn.network_table``, Issue 44):

- ``POST /v1/messages`` (``?beta=true`` or not): a streamed answer (server-sent events
  ``message_start``, ``content_block_start``, one ``content_block_delta``/``text_delta`` per
  scripted delta, ``content_block_stop``, ``message_delta`` with ``stop_reason: end_turn``,
  ``message_stop``) or, without ``stream: true``, the same message as one JSON object;
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``;
- anything else: 404 (recorded too, so a test sees what the agent tried).

Every request is recorded (``requests``): method, path, headers (lower-cased names) and the
decoded JSON body, so a test checks the key the agent sent (``x-api-key``) and the conversation
it carried (``messages``).

Which answer a request gets: the agent's *conversation* requests (those that carry ``tools``:
the agent offers its tools on every turn of the conversation) take the next ``Script`` queued with
``script()``; everything else (a title or summary the agent asks for on the side) and a
conversation request with nothing queued gets ``Script(["ok"])``. A script sets the deltas, the
pace between them, and optionally a point after which the stream waits for ``release()`` (so a
test can act at a known moment mid-stream).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

MAX_BODY = 16 * 1024 * 1024


@dataclass
class Script:
    """One streamed answer: ``deltas`` sent ``pace`` seconds apart; after ``hold_after`` deltas
    (None: never) the stream waits until ``release()`` (at most ``hold_timeout`` seconds)."""

    deltas: list[str]
    pace: float = 0.0
    hold_after: int | None = None
    hold_timeout: float = 120.0
    released: threading.Event = field(default_factory=threading.Event)
    sent: int = 0  # deltas written so far (read by the test)
    done: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    conversation: bool = False  # a turn of the agent's conversation (the stand-in's own rule)
    turns: tuple[tuple[str, str], ...] = ()  # (role, text) of every text the request carries, in order

    @property
    def is_conversation(self) -> bool:
        return self.conversation

    def texts(self) -> list[tuple[str, str]]:
        """``(role, text)`` of every text block of the request's conversation, in order (roles as
        the provider names them: Messages and Responses ``user``/``assistant``, Gemini ``user``/``model``)."""
        return list(self.turns)


def messages_texts(body: Any) -> list[tuple[str, str]]:
    """``(role, text)`` of every text block of a Messages request's ``messages``."""
    out: list[tuple[str, str]] = []
    messages = body.get("messages") if isinstance(body, dict) else None
    for message in messages or []:
        content = message.get("content")
        if isinstance(content, str):
            out.append((message.get("role"), content))
            continue
        for block in content or []:
            if isinstance(block, dict) and block.get("type") == "text":
                out.append((message.get("role"), block.get("text", "")))
    return out


class StandIn:
    """A provider API on 127.0.0.1: the HTTP server, the queue of scripted answers and the record
    of every request. A provider's stand-in says which requests are its conversation
    (``_conversation``), what texts they carry (``_texts``) and how to answer (``_serve``)."""

    name = "standin"

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self._scripts: deque[Script] = deque()
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self, port: int = 0) -> Self:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler_class(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        for script in list(self._scripts):
            script.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def network_table(self) -> str:
        """The ``[network]`` table that lets agents reach this stand-in through their egress proxy
        (a private address: only an exact ``host_ports`` entry admits it, Issue 44)."""
        assert self._server is not None, "not started"
        return f'[network]\nhost_ports = ["127.0.0.1:{self._server.server_address[1]}"]\n\n'

    def script(self, deltas: list[str], pace: float = 0.0, hold_after: int | None = None) -> Script:
        """Queue the answer of the next conversation request."""
        s = Script(list(deltas), pace, hold_after)
        with self._lock:
            self._scripts.append(s)
        return s

    def conversation(self) -> list[Recorded]:
        """The conversation requests received so far, in order."""
        with self._lock:
            return [r for r in self.requests if r.is_conversation]

    def wait_for_conversation(self, count: int, timeout: float = 60.0) -> list[Recorded]:
        """The conversation requests once there are at least ``count``."""
        from tests.support.waiting import wait_until

        return wait_until(lambda: c if len(c := self.conversation()) >= count else None, timeout=timeout,
                          message=f"{count} conversation request(s) at the {self.name}")

    # ------------------------------------------------------------------ serving
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("content-length") or 0)
        raw = h.rfile.read(min(length, MAX_BODY)) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        path = h.path.split("?")[0]
        conversation = h.command == "POST" and self._conversation(path, body)
        rec = Recorded(h.command, h.path, {k.lower(): v for k, v in h.headers.items()}, body, conversation,
                       tuple(self._texts(body)) if conversation else ())
        with self._lock:
            self.requests.append(rec)
            script = self._scripts.popleft() if rec.is_conversation and self._scripts else None
        self._serve(h, path, body, script, rec)

    def _conversation(self, path: str, body: Any) -> bool:
        raise NotImplementedError

    def _texts(self, body: Any) -> list[tuple[str, str]]:
        raise NotImplementedError

    def _serve(self, h: BaseHTTPRequestHandler, path: str, body: Any, script: Script | None, rec: Recorded) -> None:
        raise NotImplementedError

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, doc: Any) -> None:
        data = json.dumps(doc).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _sse(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.send_header("cache-control", "no-cache")
        h.send_header("connection", "close")
        h.end_headers()
        h.close_connection = True

    @staticmethod
    def _event(h: BaseHTTPRequestHandler, data: dict[str, Any], name: str | None = None) -> None:
        head = f"event: {name}\n" if name else ""
        h.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
        h.wfile.flush()

    @staticmethod
    def _paced(script: Script) -> Iterator[tuple[int, str]]:
        """The script's deltas at its pace, holding where it says; counts what was sent."""
        for i, delta in enumerate(script.deltas):
            if script.hold_after is not None and i == script.hold_after:
                script.released.wait(script.hold_timeout)
            if i and script.pace:
                time.sleep(script.pace)
            yield i, delta
            script.sent = i + 1


class MessagesStandIn(StandIn):
    """The Anthropic Messages API. Start with ``start()`` (or as a context manager); ``base_url``
    is what ``ANTHROPIC_BASE_URL`` gets."""

    name = "messages-standin"

    def _conversation(self, path: str, body: Any) -> bool:
        return path == "/v1/messages" and isinstance(body, dict) and bool(body.get("tools"))

    def _texts(self, body: Any) -> list[tuple[str, str]]:
        return messages_texts(body)

    def _serve(self, h: BaseHTTPRequestHandler, path: str, body: Any, script: Script | None, rec: Recorded) -> None:
        if h.command != "POST":
            return self._json(h, 404, {"type": "error", "error": {"type": "not_found_error", "message": h.path}})
        if path == "/v1/messages/count_tokens":
            return self._json(h, 200, {"input_tokens": 42})
        if path != "/v1/messages" or not isinstance(body, dict):
            return self._json(h, 404, {"type": "error", "error": {"type": "not_found_error", "message": h.path}})
        script = script or Script(["ok"])
        model = str(body.get("model") or "claude-standin")
        if body.get("stream"):
            self._stream(h, script, model)
        else:
            text = "".join(script.deltas)
            script.sent = len(script.deltas)
            script.done.set()
            self._json(h, 200, {
                "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 10, "output_tokens": max(1, len(script.deltas))},
            })

    def _stream(self, h: BaseHTTPRequestHandler, script: Script, model: str) -> None:
        self._sse(h)

        def event(name: str, data: dict[str, Any]) -> None:
            self._event(h, data, name)

        msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            event("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}})
            event("content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}})
            for _i, delta in self._paced(script):
                event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": delta}})
            event("content_block_stop", {"type": "content_block_stop", "index": 0})
            event("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                    "usage": {"output_tokens": max(1, len(script.deltas))}})
            event("message_stop", {"type": "message_stop"})
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            script.done.set()


def main(argv: list[str] | None = None) -> None:
    """Run as a process (e.g. inside a sdbox, whose network the test's own process cannot reach):
    every conversation request gets ``--deltas``; each request is appended to ``--record`` as one
    JSON line ``{method, path, headers, body}``."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--deltas", required=True, help="a JSON list of strings")
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args(argv)
    deltas = json.loads(args.deltas)
    standin = MessagesStandIn()

    class Recording(list):  # appends each request to the file as it is recorded
        def append(self, rec: Recorded) -> None:
            super().append(rec)
            with open(args.record, "a", encoding="utf-8") as out:
                out.write(json.dumps({"method": rec.method, "path": rec.path, "headers": rec.headers,
                                      "body": rec.body}) + "\n")
            if rec.is_conversation:
                standin.script(deltas, args.pace)

    standin.requests = Recording()
    standin.start(args.port)
    assert standin._thread is not None
    standin._thread.join()


def _handler_class(standin: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:  # noqa: N802
            standin._handle(self)

        def do_GET(self) -> None:  # noqa: N802
            standin._handle(self)

    return Handler


if __name__ == "__main__":
    main()
