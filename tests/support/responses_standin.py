"""The tests' own local stand-in of the OpenAI Responses API (Issue 22), for Codex.

``POST /v1/responses`` (or ``/responses`` under whatever base the agent was given) with ``stream:
true`` answers server-sent events as the Responses API streams them: ``response.created``,
``response.output_item.added`` (an assistant ``message``), ``response.content_part.added``, one
``response.output_text.delta`` per scripted delta at the script's pace, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (with usage).
Anything else: 404, recorded too. A conversation request is one that asks for no structured output
(``text.format``: Codex asks for its session's title on the side as a JSON object, which gets
``{"title": "Stand-in title"}``); its texts (``Recorded.texts()``) are the ``input`` messages' text parts, ``(role, text)``,
in order: Codex sends the whole history every turn. Scripts and recording work as in
``tests/support/messages_standin.py``.
"""

from __future__ import annotations

import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.support.messages_standin import Recorded, Script, StandIn


def _input_texts(body: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    items = body.get("input") if isinstance(body, dict) else None
    if isinstance(items, str):
        return [("user", items)]
    for item in items or []:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        content = item.get("content")
        if isinstance(content, str):
            out.append((str(item.get("role")), content))
            continue
        for part in content or []:
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
                out.append((str(item.get("role")), str(part.get("text", ""))))
    return out


def _structured(body: dict[str, Any]) -> bool:
    text = body.get("text")
    return isinstance(text, dict) and bool(text.get("format"))


class ResponsesStandIn(StandIn):
    """``base_url`` (ending in ``/v1``) is what a Codex ``model_provider``'s ``base_url`` gets."""

    name = "responses-standin"

    @property
    def base_url(self) -> str:
        return super().base_url + "/v1"

    def _conversation(self, path: str, body: Any) -> bool:
        return path.endswith("/responses") and isinstance(body, dict) and not _structured(body)

    def _texts(self, body: Any) -> list[tuple[str, str]]:
        return _input_texts(body)

    def _serve(self, h: BaseHTTPRequestHandler, path: str, body: Any, script: Script | None, rec: Recorded) -> None:
        if h.command != "POST" or not path.endswith("/responses") or not isinstance(body, dict):
            return self._json(h, 404, {"error": {"type": "invalid_request_error", "message": f"no route {h.path}"}})
        default = Script(['{"title": "Stand-in title"}'] if _structured(body) else ["ok"])
        self._stream(h, script or default, str(body.get("model") or "gpt-standin"))

    def _stream(self, h: BaseHTTPRequestHandler, script: Script, model: str) -> None:
        self._sse(h)
        resp_id, item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        seq = 0

        def event(kind: str, **fields: Any) -> None:
            nonlocal seq
            self._event(h, {"type": kind, "sequence_number": seq, **fields}, kind)
            seq += 1

        def response(status: str, output: list[Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
            return {"id": resp_id, "object": "response", "created_at": 0, "status": status, "model": model,
                    "output": output, "usage": usage}

        try:
            event("response.created", response=response("in_progress", []))
            event("response.in_progress", response=response("in_progress", []))
            event("response.output_item.added", output_index=0, item={
                "id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []})
            event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": []})
            for _i, delta in self._paced(script):
                event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=delta)
            text = "".join(script.deltas)
            part = {"type": "output_text", "text": text, "annotations": []}
            item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
            event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text)
            event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
            event("response.output_item.done", output_index=0, item=item)
            event("response.completed", response=response("completed", [item], {
                "input_tokens": 10, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": max(1, len(script.deltas)), "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 10 + max(1, len(script.deltas))}))
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            script.done.set()
