"""The tests' own local stand-in of the Gemini API (Issue 22), for Gemini CLI.

- ``POST /v1beta/models/<model>:streamGenerateContent?alt=sse``: server-sent events, one
  ``GenerateContentResponse`` (``candidates[0].content.parts[0].text``) per scripted delta at the
  script's pace, the last with ``finishReason: STOP`` and ``usageMetadata``;
- ``POST .../<model>:generateContent``: the same answer as one JSON object (a side question the
  CLI asks, e.g. its next-speaker check, whose JSON schema is answered with ``next_speaker: user``);
- ``POST .../<model>:countTokens``: ``{"totalTokens": N}``;
- anything else: 404, recorded too.

A conversation request is a ``streamGenerateContent`` one that offers ``tools`` (the CLI offers its
tools on every turn of its conversation); its texts (``Recorded.texts()``) are the ``contents``'
text parts, ``(role, text)`` with Gemini's roles ``user`` and ``model``, in order. Scripts and
recording work as in ``tests/support/messages_standin.py``. ``base_url`` (no ``/v1beta``) is what
``GOOGLE_GEMINI_BASE_URL`` gets; the key arrives in the ``x-goog-api-key`` header.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.support.messages_standin import Recorded, Script, StandIn


def _contents_texts(body: Any) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    contents = body.get("contents") if isinstance(body, dict) else None
    for content in contents or []:
        if not isinstance(content, dict):
            continue
        for part in content.get("parts") or []:
            if isinstance(part, dict) and isinstance(part.get("text"), str) and not part.get("thought"):
                out.append((str(content.get("role")), part["text"]))
    return out


def _chunk(text: str, model: str, finish: bool) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}
    doc: dict[str, Any] = {"candidates": [candidate], "modelVersion": model}
    if finish:
        candidate["finishReason"] = "STOP"
        doc["usageMetadata"] = {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15}
    return doc


class GeminiStandIn(StandIn):
    name = "gemini-standin"

    def _conversation(self, path: str, body: Any) -> bool:
        return path.endswith(":streamGenerateContent") and isinstance(body, dict) and bool(body.get("tools"))

    def _texts(self, body: Any) -> list[tuple[str, str]]:
        return _contents_texts(body)

    def _serve(self, h: BaseHTTPRequestHandler, path: str, body: Any, script: Script | None, rec: Recorded) -> None:
        if h.command != "POST" or not isinstance(body, dict) or ":" not in path:
            return self._json(h, 404, {"error": {"code": 404, "message": f"no route {h.path}", "status": "NOT_FOUND"}})
        model = path.rsplit("/", 1)[-1].split(":", 1)[0]
        method = path.rsplit(":", 1)[-1]
        if method == "countTokens":
            return self._json(h, 200, {"totalTokens": 42})
        if method == "generateContent":
            config = body.get("generationConfig") or {}
            if config.get("responseMimeType") == "application/json" or config.get("responseJsonSchema") \
                    or config.get("responseSchema"):
                text = json.dumps({"reasoning": "the model answered; the user speaks next", "next_speaker": "user"})
            else:
                text = "".join((script or Script(["ok"])).deltas)
            return self._json(h, 200, _chunk(text, model, True))
        if method != "streamGenerateContent":
            return self._json(h, 404, {"error": {"code": 404, "message": f"no method {method}", "status": "NOT_FOUND"}})
        script = script or Script(["ok"])
        self._sse(h)
        try:
            last = len(script.deltas) - 1
            for i, delta in self._paced(script):
                self._event(h, _chunk(delta, model, i == last))
            if last < 0:
                self._event(h, _chunk("", model, True))
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            script.done.set()
