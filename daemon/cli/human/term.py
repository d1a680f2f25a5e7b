"""Colour and width for one output stream, as people expect from ``gh``, ``git`` and ``systemctl``.

Colour only when the stream is a terminal, ``NO_COLOR`` is not set (any value, even empty, turns
colour off) and ``TERM`` is not ``dumb``. Lines are cut to the terminal's width only on a
terminal; into a pipe or a file every line is printed whole, so nothing is lost to ``grep``.
"""

from __future__ import annotations

import os
from enum import Enum

from daemon.cli.human import terminal_columns

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import IO


class Colour(str, Enum):
    """SGR codes of the few styles used."""

    BOLD = "1"
    DIM = "2"
    RED = "31"
    GREEN = "32"
    YELLOW = "33"
    BLUE = "34"
    MAGENTA = "35"
    CYAN = "36"


class Term:
    """How to write to one stream: with colour or not, cut to a width or not, with Unicode or ASCII.
    (A plain class, not a dataclass: see ``daemon.cli.human``.)"""

    __slots__ = ("colour", "width", "unicode")

    def __init__(self, colour: bool = False, width: int | None = None, unicode: bool = True) -> None:
        self.colour = colour
        self.width = width  # None: not a terminal, never cut
        self.unicode = unicode

    def __repr__(self) -> str:
        return f"Term(colour={self.colour}, width={self.width}, unicode={self.unicode})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Term) and (other.colour, other.width, other.unicode) == (
            self.colour, self.width, self.unicode)

    def __hash__(self) -> int:
        return hash((self.colour, self.width, self.unicode))

    @classmethod
    def for_stream(cls, stream: IO[str], environ: Mapping[str, str] | None = None) -> Term:
        env = os.environ if environ is None else environ
        try:
            tty = stream.isatty()
        except (AttributeError, ValueError):
            tty = False
        colour = tty and "NO_COLOR" not in env and env.get("TERM") != "dumb"
        width = terminal_columns(100) if tty else None
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "")
        return cls(colour=colour, width=width, unicode=encoding.startswith("utf"))

    def paint(self, text: str, *styles: Colour) -> str:
        if not self.colour or not styles or not text:
            return text
        return f"\x1b[{';'.join(s.value for s in styles)}m{text}\x1b[0m"

    def bold(self, text: str) -> str:
        return self.paint(text, Colour.BOLD)

    def dim(self, text: str) -> str:
        return self.paint(text, Colour.DIM)

    def red(self, text: str) -> str:
        return self.paint(text, Colour.RED)

    def green(self, text: str) -> str:
        return self.paint(text, Colour.GREEN)

    def yellow(self, text: str) -> str:
        return self.paint(text, Colour.YELLOW)

    def cyan(self, text: str) -> str:
        return self.paint(text, Colour.CYAN)

    def magenta(self, text: str) -> str:
        return self.paint(text, Colour.MAGENTA)

    @property
    def ellipsis(self) -> str:
        return "\u2026" if self.unicode else "..."

    @property
    def bullet(self) -> str:
        return "\u25cf" if self.unicode else "*"

    def cut(self, text: str, width: int | None) -> str:
        """``text`` shortened to ``width`` characters with an ellipsis (None: unchanged)."""
        if width is None or len(text) <= width:
            return text
        if width <= len(self.ellipsis):
            return text[:width]
        return text[: width - len(self.ellipsis)] + self.ellipsis

    def line(self, text: str) -> str:
        """A plain line cut to the terminal width (on a terminal)."""
        return self.cut(text, self.width)
