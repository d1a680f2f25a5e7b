"""Text an agent sent, made valid Unicode: each lone surrogate becomes U+FFFD.

JSON lets a writer escape a lone UTF-16 surrogate (``"\\ud800"``); JavaScript's ``JSON.stringify``
does exactly that for a string cut inside a surrogate pair (a tool's output truncated in the
middle of an emoji, say). ``json.loads`` keeps such a string, and UTF-8 cannot encode it: msgpack,
SQLite and the journal all refuse it. One such string in what an agent said would make every
frame that carries it unsendable: an event, a spawn's answer, or the enumeration of every
instance on the server. So the transport cleans what it decodes (``clean``, only for the lines
that hold a ``\\u`` escape of a surrogate at all), and the event log's last-resort ``plain`` cleans
strings too (``clean_str``).
"""

from __future__ import annotations

import re
from typing import Any

# Where a lone surrogate can come from in a line of JSON: a \uD800-\uDFFF escape (raw surrogate
# bytes are not UTF-8, and such a line is not decoded at all). An escaped backslash before "u"
# matches as well; that only costs the (correct) slow path.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


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
