"""Print the table from requirement ID to the tests that cite it (tests/README.md embeds it).

Run: ``python tests/ac_table.py``. A test cites an ID by writing it in full
(``AC-EXECUTORS-SURVIVAL-003.7``, ``RESUME-5``, ``RESETCFG-9``, ``LEASE-CTX-3``,
``Issue 10 scenario A``; docs/requirements.md defines each) in its name, docstring or
body; module docstrings count for every test of the module.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ID = re.compile(
    r"AC-EXECUTORS-[A-Z-]+-\d{3}\.\d+|(?:RESUME|RESETCFG)-T?\d+|(?:LEASE|NPM)-CTX-\d+"
    r"|Issue \d+ scenario [A-Z](?![\w-])"
)
FAMILIES = ("AC-EXECUTORS-SURVIVAL", "AC-EXECUTORS-CONTROL-OWNERSHIP", "RESUME", "RESETCFG", "NPM-CTX",
            "LEASE-CTX", "Issue")
ROOT = Path(__file__).resolve().parent


def _order(ident: str) -> tuple[int, bool, list[int], str]:
    """Families in the order of docs/requirements.md, then numerically (RESUME-T1 after RESUME-13)."""
    rank = next(i for i, family in enumerate(FAMILIES) if ident.startswith(family))
    return rank, "-T" in ident, [int(n) for n in re.findall(r"\d+", ident)], ident


def collect() -> dict[str, set[str]]:
    cited: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("test_*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        module_ids = set(ID.findall(ast.get_docstring(tree) or ""))
        rel = path.relative_to(ROOT.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                source = ast.get_source_segment(text, node) or ""
                for ident in set(ID.findall(source)) | module_ids:
                    cited[ident].add(f"`{rel}::{node.name}`")
    return cited


def main() -> None:
    cited = collect()
    print("| requirement | tests |")
    print("|---|---|")
    for ident in sorted(cited, key=_order):
        tests = sorted(cited[ident])
        shown = "<br>".join(tests[:6]) + (f"<br>… and {len(tests) - 6} more" if len(tests) > 6 else "")
        print(f"| {ident} | {shown} |")


if __name__ == "__main__":
    main()
