"""Decoding a line an agent wrote: JSON made safe to carry, store and log.

What an agent writes on its stdout is attacker input, and ``json.loads`` accepts two things that
would make a message impossible to pass on:

- **A lone UTF-16 surrogate.** JSON can escape one (``"\\ud800"``), and JavaScript's
  ``JSON.stringify`` writes one for a string cut inside a surrogate pair (a tool's output
  truncated in the middle of an emoji, say). UTF-8 cannot encode it, so msgpack, SQLite and the
  journal all refuse it. Every string (keys included) gets each lone surrogate replaced by U+FFFD
  (``clean``); an escaped pair stays the one character it is.
- **Deep nesting.** ``json.loads`` goes about a thousand levels deep; the backend's JSON encoders
  (a transcript entry's text, a session's metadata column) and even ``repr`` of the error then hit
  Python's recursion limit, so one such event failed its batch again at every retry and the
  session's stream stopped there. Whatever lies deeper than ``MAX_DEPTH`` levels is replaced by
  the string ``CUT`` (``prune``): the message keeps its shape above that (a prompt's answer still
  ends its turn). A line too deep for ``json.loads`` itself is not JSON to us.

Both walks run only for the lines that can need them: pydantic-core's parser decodes a line
unless it holds a lone surrogate or nests past 200 levels (then ``json.loads`` does, and
``clean`` runs if a surrogate escape is there at all), and ``prune`` runs for a line with more
than ``MAX_DEPTH`` brackets. The common line pays the fast parse and two byte counts.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic_core import from_json

MAX_DEPTH = 64
"""Levels of arrays and objects kept in a message from an agent (ACP's own messages use under ten)."""

CUT = f"[cut: nested deeper than {MAX_DEPTH} levels]"

# Where a lone surrogate can come from in a line of JSON: a \uD800-\uDFFF escape (raw surrogate
# bytes are not UTF-8, and such a line is not decoded at all). An escaped backslash before "u"
# matches as well; that only costs the (correct) slow path.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def decode(line: bytes) -> Any:
    """One line from an agent as a JSON value, cleaned and pruned; ``ValueError`` if it is not JSON
    (not UTF-8, not one JSON text, or nested too deep to decode)."""
    try:
        # pydantic-core's parser (in Rust): twice as fast as json.loads, the same values, and it
        # refuses lone surrogates and nesting past 200 levels, which the slow path then takes.
        value = from_json(line, cache_strings="keys")
    except ValueError:
        value = _decode_slowly(line)
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH:
        value = prune(value)
    return value


def _decode_slowly(line: bytes) -> Any:
    try:
        value = json.loads(line.decode("utf-8"))  # ACP speaks UTF-8 (bytes would be guessed at)
    except RecursionError:
        raise ValueError("nested too deep to decode") from None
    return clean(value) if SURROGATE_ESCAPE.search(line) else value


def clean_str(value: str) -> str:
    """``value``, with each lone surrogate replaced by U+FFFD (a pair stays the character it is)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return value


def clean(value: Any) -> Any:
    """A decoded JSON value with every string (keys included) passed through ``clean_str``."""
    if isinstance(value, str):
        return clean_str(value)
    if isinstance(value, dict):
        return {clean_str(k) if isinstance(k, str) else k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def prune(value: Any, depth: int = 0) -> Any:
    """A decoded JSON value with each array or object below ``MAX_DEPTH`` levels replaced by ``CUT``."""
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        return CUT
    if isinstance(value, dict):
        return {k: prune(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [prune(v, depth + 1) for v in value]
    return value
