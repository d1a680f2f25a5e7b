"""Aligned tables like ``docker ps`` and ``kubectl get``: an upper-case header, two spaces between
columns, and on a terminal one flexible column (e.g. a title) cut so that a row fits the width."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from daemon.human.term import Colour, Term

GAP = "  "
MIN_FLEX = 8


@dataclass(frozen=True)
class Cell:
    """A table cell: its text and how to paint it (widths count the text only)."""

    text: str
    styles: tuple[Colour, ...] = ()


def cell(text: object, *styles: Colour) -> Cell:
    return Cell("-" if text is None or text == "" else str(text), styles)


def render_table(term: Term, headers: Sequence[str], rows: Sequence[Sequence[Cell | str]],
                 flex: int | None = None) -> list[str]:
    """The lines of the table; column ``flex`` gives way when the terminal is too narrow."""
    grid = [[c if isinstance(c, Cell) else cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in grid:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c.text))
    if flex is not None and term.width is not None:
        total = sum(widths) + len(GAP) * (len(widths) - 1)
        if total > term.width:
            widths[flex] = max(MIN_FLEX, len(headers[flex]), widths[flex] - (total - term.width))
    lines = [_join(term, [Cell(h, (Colour.BOLD,)) for h in headers], widths)]
    lines += [_join(term, row, widths) for row in grid]
    return lines


def _join(term: Term, row: Sequence[Cell], widths: Sequence[int]) -> str:
    parts = []
    last = len(row) - 1
    for i, c in enumerate(row):
        text = term.cut(c.text, widths[i])
        pad = "" if i == last else " " * (widths[i] - len(text))
        parts.append(term.paint(text, *c.styles) + pad)
    return GAP.join(parts).rstrip()
