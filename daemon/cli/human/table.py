"""Aligned tables like ``docker ps`` and ``kubectl get``: an upper-case header, two spaces between
columns, and on a terminal flexible columns (e.g. a title) cut, one after the other, so that a row
fits the width; if it still does not fit, the row is cut at the terminal's edge (as ``systemctl``
does)."""

from __future__ import annotations

from daemon.cli.human.term import Colour, Term

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from collections.abc import Sequence

GAP = "  "
MIN_FLEX = 8


class Cell:
    """A table cell: its text and how to paint it (widths count the text only). (A plain class, not
    a dataclass: see ``daemon.cli.human``.)"""

    __slots__ = ("text", "styles")

    def __init__(self, text: str, styles: tuple[Colour, ...] = ()) -> None:
        self.text = text
        self.styles = styles

    def __repr__(self) -> str:
        return f"Cell({self.text!r}, {self.styles!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cell) and (other.text, other.styles) == (self.text, self.styles)

    def __hash__(self) -> int:
        return hash((self.text, self.styles))


def cell(text: object, *styles: Colour) -> Cell:
    return Cell("-" if text is None or text == "" else str(text), styles)


def render_table(term: Term, headers: Sequence[str], rows: Sequence[Sequence[Cell | str]],
                 flex: int | Sequence[int] | None = None) -> list[str]:
    """The lines of the table; the ``flex`` columns give way when the terminal is too narrow, one
    after the other in the order given, each down to ``MIN_FLEX`` (or its header's width)."""
    grid = [[c if isinstance(c, Cell) else cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in grid:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c.text))
    width = term.width
    for column in ([] if flex is None or width is None else [flex] if isinstance(flex, int) else flex):
        over = sum(widths) + len(GAP) * (len(widths) - 1) - (width or 0)
        if over <= 0:
            break
        widths[column] = max(MIN_FLEX, len(headers[column]), widths[column] - over)
    lines = [_join(term, [Cell(h, (Colour.BOLD,)) for h in headers], widths)]
    lines += [_join(term, row, widths) for row in grid]
    return lines


def _join(term: Term, row: Sequence[Cell], widths: Sequence[int]) -> str:
    """One row; on a terminal still too narrow for it, the row is cut at the width (with an ellipsis)."""
    parts: list[str] = []
    last = len(row) - 1
    used = 0
    for i, c in enumerate(row):
        width = widths[i]
        if term.width is not None:
            room = term.width - used - (len(GAP) if parts else 0)
            if room <= 0:
                break
            if width > room:
                width, last = room, i
        text = term.cut(c.text, width)
        pad = "" if i == last else " " * (width - len(text))
        parts.append(term.paint(text, *c.styles) + pad)
        used += width + (len(GAP) if len(parts) > 1 else 0)
        if i == last:
            break
    return GAP.join(parts).rstrip()
