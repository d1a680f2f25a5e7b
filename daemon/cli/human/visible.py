"""Text an agent wrote, made safe to print on a person's terminal.

A terminal obeys the control characters it is sent: an escape sequence in an agent's chunk, a
tool call's title or an error message could clear the screen, rewrite lines above (a forged
"turn ended" or permission prompt), retitle the window or set the clipboard (OSC 52) for the
next paste. Every string a human view prints came from the backend, and much of it from an agent,
so the views get it with each control character but newline and tab shown escaped (``\\x1b``);
a CRLF line end is a plain newline. ``--json`` output needs none of this: JSON escapes them.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the CLI's import budget)
if TYPE_CHECKING:
    from typing import Any

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")


def visible(text: str) -> str:
    """``text`` with every control character but newline and tab escaped as ``\\xNN``."""
    if _CONTROL.search(text) is None:
        return text
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))


def visible_data(value: Any) -> Any:
    """A result from the backend with ``visible`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {visible(k) if isinstance(k, str) else k: visible_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [visible_data(v) for v in value]
    return value
