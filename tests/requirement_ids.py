"""Requirement ids cited in the repository: one form each, and an entry in docs/requirements.md.

Run: ``python tests/requirement_ids.py`` lists every problem (exit 1 if there is one);
``python tests/requirement_ids.py --fix`` first rewrites every citation whose canonical form is
certain, then lists what is left for a person to decide. ``tests/unit/test_requirement_ids.py``
runs the check in the suite.

Canonical forms (docs/requirements.md, "How ids are written"): ``AC-EXECUTORS-SURVIVAL-001.6``,
``AC-EXECUTORS-CONTROL-OWNERSHIP-002.3``, ``REQ-EXECUTORS-SURVIVAL-004``, ``RESUME-5``,
``RESUME-T3``, ``RESETCFG-13``, ``NPM-CTX-1``, ``LEASE-CTX-3``, ``Issue 10``,
``Issue 10 scenario A``, ``Issue 10 item 5``; each written in full every time.

Problems found:

- ``old form``: a citation written another way: a short prefix (``SURVIVAL-001.6``,
  ``OWN-002.3``, ``AC-OWN-001.11``...), a bare number (``(002.3)``), a range or slash list
  (``RESUME-1..4``, ``LEASE-CTX-5/6``, ``003.2..003.5``), a scenario or item without its issue,
  a lower-case or plural ``issue``. ``--fix`` rewrites the ones that name one id for certain: a
  short prefix, a list or range after a full id, an issue's scenarios and items, and a bare
  number that only one family defines or whose file cites only one of the families defining it.
- ``no entry``: a canonical id that docs/requirements.md does not define.
- ``outside reference``: a pointer to a document that is not in the repository (the team's
  design pages, requirement specs, seeds, or a ``§`` section of any of them). ``--fix``
  rewrites the design pages' sections that have one home in docs/ (``DESIGN_SECTIONS``).
- ``dangling pointer``: ``docs/architecture.md#x``, ``docs/requirements.md#x`` or
  ``README.md#x`` where the page has no heading whose anchor is ``x``.

Every file git knows in the repository (tracked, or new and not ignored) is read, wherever it
lives; a file that must spell the old forms out (this checker and its unit test) says so with a
line holding ``requirement-ids: not scanned``.
"""

from __future__ import annotations

import bisect
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "docs" / "requirements.md"
NOT_SCANNED = "requirement-ids: not scanned"  # requirement-ids: not scanned
# Only used when git is not available: directories never worth reading.
SKIPPED_DIRS = {"__pycache__", ".venv", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".git", "node_modules",
                "build", "dist"}

SURVIVAL = "AC-EXECUTORS-SURVIVAL-"
OWNERSHIP = "AC-EXECUTORS-CONTROL-OWNERSHIP-"

# ------------------------------------------------------------------ canonical forms
CANONICAL = re.compile(
    r"(?<![\w-])(?:"
    r"AC-EXECUTORS-(?:SURVIVAL|CONTROL-OWNERSHIP)-\d{3}\.\d+"
    r"|REQ-EXECUTORS-(?:SURVIVAL|CONTROL-OWNERSHIP)-\d{3}(?![.\d])"
    r"|(?:RESUME|RESETCFG)-T?\d+"
    r"|(?:NPM|LEASE)-CTX-\d+"
    r"|Issue \d+ (?:scenario [A-Z]|item \d+)(?![\w-])"
    r"|Issue \d+(?![\w-])"
    r")"
)

# ------------------------------------------------------------------ old forms
# A survival or ownership id with any prefix; canonical only when the prefix is the full one.
_AC_ANY = re.compile(
    r"(?<![\w-])(?:AC-)?(?:EXECUTORS-)?"
    r"(?P<family>SURV(?:IVAL)?|(?:CONTROL-)?OWN(?:ERSHIP)?)-(?P<num>\d{3}\.\d+)"
)
_REQ_ANY = re.compile(r"(?<![\w-])REQ-[A-Z-]*\d{3}(?![.\d])")
# A bare criterion number: (002.3), 001.5, ... (not part of a version, a path or a full id).
_BARE = re.compile(r"(?<![\w.\-/:@])0\d\d\.\d+(?!\.?\d)")
# A full id followed by a range or a list of bare numbers: 003.2..003.5, RESUME-1..4, LEASE-CTX-5/6.
_AC_LIST = re.compile(
    r"(?P<head>AC-EXECUTORS-(?:SURVIVAL|CONTROL-OWNERSHIP)-)(?P<first>\d{3}\.\d+)"
    r"(?P<rest>(?:\s*(?:\.\.|,|/|,?\s+and|,?\s+or)\s*\d{3}\.\d+(?![.\d]))+)"
)
_NUM_LIST = re.compile(
    r"(?<![\w-])(?P<head>(?:RESUME|RESETCFG)-|(?:NPM|LEASE)-CTX-)(?P<first>\d+)"
    r"(?P<rest>(?:(?:\.\.|/|,\s*|\s+and\s+)\d+(?![\w%-]|\.\d))+)(?![\w.])"
)
# Issue citations in any spelling: "issue 5, scenario C", "Issue 14 scenarios A-E", "issue #3",
# "Issue 11 (build item 5)", "issues 2-6".
_ISSUE_SCENARIOS = re.compile(
    r"(?<![\w-])[Ii]ssue #?(?P<issue>\d+),?\s+[Ss]cenarios?\s+"
    r"(?P<letters>[A-Z](?:\s*(?:[-–]|,\s*and|,|and|&)\s*[A-Z](?![\w-]))*)(?![\w-])"
)
_NUMS = r"\d+(?:\s*(?:[-–]|,|and)\s*\d+)*"
_ISSUE_ITEMS = re.compile(
    r"(?<![\w-])[Ii]ssue #?(?P<issue>\d+),?\s+"
    rf"(?:\((?:build\s+)?items?\s+(?P<pnums>{_NUMS})\)|(?:build\s+)?items?\s+(?P<nums>{_NUMS}))(?![\w-])"
)
_ISSUE_ANY = re.compile(r"(?<![\w-])(?:[Ii]ssues?)\s+#?\d+")
_SCENARIO_ANY = re.compile(r"(?<![\w-])[Ss]cenarios?\s+[A-Z](?![\w-])")

OUTSIDE = re.compile(
    r"design\.md|design-notes|design card|\.\./shared|/work/shared|§"
    r"|(?<![\w/])spec/[\w.-]+|(?<![\w-])seeds?(?:\s+0\d\d|/)"
    r"|(?<![\w/.-])(?:survival|ownership|resume-and-config)\.md"
    r"|(?:acp-runtime-config-across-context-reset|agent-resume-runtime-recovery|survived-session-state)"
)

# Where the numbered sections of the design pages kandev was built from (not in this repository)
# are now explained: ``--fix`` rewrites "design.md §5" into "docs/architecture.md#ownership".
# Section 7 of design.md (the backend) and the seeds cover too many subjects for one pointer:
# those references are rewritten by hand.
_ARCH = "docs/architecture.md#"
DESIGN_SECTIONS = {
    "1": _ARCH + "processes", "2": _ARCH + "lifetimes", "3": _ARCH + "the-home",
    "4": _ARCH + "the-ipc-protocol-ipc", "5": _ARCH + "ownership", "6": _ARCH + "the-control-server-inside",
    "8": "README.md#using-it", "10": "README.md#configuration",
}
NOTES_SECTIONS = {
    "3": _ARCH + "lifetimes", "6.1": _ARCH + "ownership", "6.2": _ARCH + "ownership",
    "6.6": _ARCH + "the-control-server-inside", "7.1": _ARCH + "startup-recovery-step-by-step",
    "9": _ARCH + "the-control-server-inside", "12": _ARCH + "lifetimes",
}
_SECTIONS = r"§\d+(?:\.\d+)?(?:(?:,\s*|/)§\d+(?:\.\d+)?)*"
_DESIGN_REF = re.compile(rf"(?P<page>design\.md|design-notes) (?P<sections>{_SECTIONS})")
_POINTER_REWRITES = (
    (re.compile(r"spec/ownership\.md(?! REQ-)"), "docs/requirements.md#control-server-ownership"),
    (re.compile(r"(?<![\w-])seed 004"), "docs/requirements.md#runtime-configuration-across-a-context-reset"),
)
# A pointer into this repository's pages: the heading it names must exist.
POINTER = re.compile(r"(?<![\w/.-])(?P<page>docs/architecture\.md|docs/operations\.md|docs/requirements\.md|README\.md)#(?P<anchor>[\w-]+)")


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    kind: str  # "old form" | "no entry" | "outside reference" | "dangling pointer"
    text: str
    hint: str = ""

    def __str__(self) -> str:
        hint = f" -> {self.hint}" if self.hint else ""
        return f"{self.path}:{self.line}: {self.kind}: {self.text!r}{hint}"


# ------------------------------------------------------------------ entries
ENTRY = re.compile(r"^- \*\*(?P<id>[^*]+)\*\*", re.M)
HEADING = re.compile(r"^#{2,4} (?P<id>REQ-EXECUTORS-[A-Z-]+-\d{3}|Issue \d+)\b", re.M)


def entries(text: str | None = None) -> list[str]:
    """Every id docs/requirements.md defines (entries ``- **ID**`` and headings), in order."""
    if text is None:
        text = REQUIREMENTS.read_text()
    found = [(m.start(), m.group("id")) for m in ENTRY.finditer(text)]
    found += [(m.start(), m.group("id")) for m in HEADING.finditer(text)]
    return [ident for _, ident in sorted(found)]


# ------------------------------------------------------------------ rewriting
def _ac_canonical(match: re.Match[str]) -> str:
    family = match.group("family")
    head = SURVIVAL if family.startswith("SURV") else OWNERSHIP
    return head + match.group("num")


def _separator(sep: str) -> str:
    """How two ids of an expanded list are joined: a range or a slash becomes ``, ``; a comma,
    ``and`` or ``or`` is kept as written (with its line break, if the list was wrapped)."""
    return ", " if sep.strip() in ("..", "/") else sep


def _expand_ac_list(match: re.Match[str]) -> str:
    head, first, rest = match.group("head"), match.group("first"), match.group("rest")
    out = head + first
    prev = first
    for sep, num in re.findall(r"(\s*(?:\.\.|,|/|,?\s+and|,?\s+or)\s*)(\d{3}\.\d+)", rest):
        if sep.strip() == "..":
            req, a = prev.split(".")
            req2, b = num.split(".")
            if req == req2 and int(a) < int(b):
                out += "".join(f", {head}{req}.{n}" for n in range(int(a) + 1, int(b) + 1))
                prev = num
                continue
        out += _separator(sep) + head + num
        prev = num
    return out


def _expand_num_list(match: re.Match[str]) -> str:
    head, first, rest = match.group("head"), int(match.group("first")), match.group("rest")
    out, last = f"{head}{first}", first
    for sep, num in re.findall(r"(\.\.|/|,\s*|\s+and\s+)(\d+)", rest):
        n = int(num)
        if sep == ".." and last < n:
            out += "".join(f", {head}{k}" for k in range(last + 1, n + 1))
        else:
            out += _separator(sep) + f"{head}{n}"
        last = n
    return out


def _and_list(cited: list[str]) -> str:
    return cited[0] if len(cited) == 1 else ", ".join(cited[:-1]) + " and " + cited[-1]


def _letters(spec: str) -> list[str]:
    letters: list[str] = []
    for part in re.split(r"\s*(?:,\s*and|,|and|&)\s*", spec):
        ends = re.split(r"\s*[-–]\s*", part.strip())
        if len(ends) == 2:
            letters += [chr(c) for c in range(ord(ends[0]), ord(ends[1]) + 1)]
        elif ends[0]:
            letters.append(ends[0])
    return letters


def _expand_scenarios(match: re.Match[str]) -> str:
    issue = match.group("issue")
    return _and_list([f"Issue {issue} scenario {x}" for x in _letters(match.group("letters"))])


def _expand_items(match: re.Match[str]) -> str:
    issue, nums = match.group("issue"), match.group("nums") or match.group("pnums")
    out: list[int] = []
    for part in re.split(r"\s*(?:,|and)\s*", nums):
        ends = re.split(r"\s*[-–]\s*", part.strip())
        if len(ends) == 2:
            out += list(range(int(ends[0]), int(ends[1]) + 1))
        elif ends[0]:
            out.append(int(ends[0]))
    return _and_list([f"Issue {issue} item {n}" for n in out])


def _bare_resolver(text: str, known: set[str]) -> Callable[[re.Match[str]], str]:
    """Name the family of a bare criterion number (``(002.3)``) when only one reading exists:
    the number is defined in one family only, or the text cites only one of the families that
    define it (in full, or by a bare number only that family defines). Otherwise the number is
    left for a person."""
    cited = {head for head in (SURVIVAL, OWNERSHIP) if head in text}
    for number in _BARE.findall(text):
        defined = [head for head in (SURVIVAL, OWNERSHIP) if head + number in known]
        cited.update(defined if len(defined) == 1 else ())

    def resolve(match: re.Match[str]) -> str:
        number = match.group(0)
        defined = [head for head in (SURVIVAL, OWNERSHIP) if head + number in known]
        if len(defined) > 1:
            defined = [head for head in defined if head in cited]
        return defined[0] + number if len(defined) == 1 else number

    return resolve


def _design_pointer(match: re.Match[str]) -> str:
    table = DESIGN_SECTIONS if match.group("page") == "design.md" else NOTES_SECTIONS
    numbers = re.findall(r"§(\d+(?:\.\d+)?)", match.group("sections"))
    if not all(n in table for n in numbers):
        return match.group(0)  # a section without one clear home: a person decides
    return " and ".join(dict.fromkeys(table[n] for n in numbers))


def fix_text(text: str, known: set[str] | None = None) -> str:
    """Rewrite every citation whose canonical form is certain; leave everything else as it is.
    With ``known`` (the ids docs/requirements.md defines), bare numbers are resolved too, where
    only one reading exists (see ``_bare_resolver``)."""
    if "SURV" in text or "OWN" in text:
        text = _AC_ANY.sub(_ac_canonical, text)
        text = _AC_LIST.sub(_expand_ac_list, text)
    if "RESUME-" in text or "RESETCFG-" in text or "-CTX-" in text:
        text = _NUM_LIST.sub(_expand_num_list, text)
    if "ssue" in text:
        text = _ISSUE_SCENARIOS.sub(_expand_scenarios, text)
        text = _ISSUE_ITEMS.sub(_expand_items, text)
        text = re.sub(r"(?<![\w-])issue (\d+)(?![\w-])", r"Issue \1", text)
    if "design" in text:
        text = _DESIGN_REF.sub(_design_pointer, text)
    if "spec/" in text or "seed" in text:
        for pattern, pointer in _POINTER_REWRITES:
            text = pattern.sub(pointer, text)
    if known is not None and _BARE.search(text):
        text = _BARE.sub(_bare_resolver(text, known), text)
    return text


# ------------------------------------------------------------------ checking
def _found(pattern: re.Pattern[str], text: str, *needles: str) -> Iterator[re.Match[str]]:
    """``pattern.finditer(text)``, skipped at once when the text holds none of the literal
    ``needles`` every match contains (most files cite nothing: this keeps the check fast)."""
    if not needles or any(needle in text for needle in needles):
        yield from pattern.finditer(text)


_ISSUE_ITEM_ANY = re.compile(r"(?<![\w-])[Ii]ssue #?\d+,?\s+\(?(?:build\s+)?items?\s+\d+")


def slug(heading: str) -> str:
    """The anchor a markdown renderer (GitHub's) gives a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(root: Path = ROOT) -> set[str]:
    """Every ``page#anchor`` a pointer may name: the headings of the pages ``POINTER`` knows."""
    found: set[str] = set()
    for page in ("docs/architecture.md", "docs/operations.md", "docs/requirements.md", "README.md"):
        path = root / page
        if path.is_file():
            found |= {f"{page}#{slug(h)}" for h in re.findall(r"^#{1,6} (.+)$", path.read_text(), re.M)}
    return found


def check_text(text: str, path: str, known: set[str], targets: set[str] | None = None) -> list[Problem]:
    """The problems of one file's text, given the ids docs/requirements.md defines (and, when
    given, every ``page#anchor`` that exists)."""
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    problems: list[Problem] = []

    def report(pos: int, kind: str, found: str, hint: str = "") -> None:
        problems.append(Problem(path, bisect.bisect_right(line_starts, pos), kind, found, hint))

    spans: list[tuple[int, int]] = []
    for m in _found(CANONICAL, text, "AC-EXECUTORS-", "REQ-EXECUTORS-", "RESUME-", "RESETCFG-", "-CTX-", "Issue "):
        spans.append(m.span())
        if m.group(0) not in known:
            report(m.start(), "no entry", m.group(0))
    starts = [s for s, _ in spans]

    def covered(m: re.Match[str]) -> bool:
        """True when the match lies inside one canonical citation (then it is not an old form)."""
        i = bisect.bisect_right(starts, m.start()) - 1
        return i >= 0 and m.end() <= spans[i][1]

    for m in _found(_AC_ANY, text, "SURV", "OWN"):
        if m.group(0) != _ac_canonical(m):
            report(m.start(), "old form", m.group(0), _ac_canonical(m))
    for m in _found(_REQ_ANY, text, "REQ-"):
        if not covered(m):
            report(m.start(), "old form", m.group(0), "REQ-EXECUTORS-SURVIVAL-<n> or REQ-EXECUTORS-CONTROL-OWNERSHIP-<n>")
    for m in _found(_BARE, text):
        report(m.start(), "old form", m.group(0), "write the id in full (survival or ownership?)")
    for m in _found(_AC_LIST, text, "AC-EXECUTORS-"):
        if re.search(r"\.\.|/", m.group("rest")):
            report(m.start(), "old form", m.group(0), "one full id per item, no range or slash list")
    for m in _found(_NUM_LIST, text, "RESUME-", "RESETCFG-", "-CTX-"):
        report(m.start(), "old form", m.group(0), "one full id per item, no range or slash list")
    if "ssue" in text:
        for m in _ISSUE_ANY.finditer(text):
            if not covered(m):
                report(m.start(), "old form", m.group(0), "Issue <n>")
        for m in _ISSUE_ITEM_ANY.finditer(text):
            if not covered(m):
                report(m.start(), "old form", m.group(0), "Issue <n> item <m>")
    for m in _found(_SCENARIO_ANY, text, "cenario"):
        if not covered(m):
            report(m.start(), "old form", m.group(0), "Issue <n> scenario <X>")
    for m in _found(OUTSIDE, text, "design", "shared", "\u00a7", "spec/", "seed", "survival.md", "ownership.md",
                    "resume-and-config", "runtime-config-across", "agent-resume", "survived-session"):
        report(m.start(), "outside reference", m.group(0), "point into docs/ or state the rule")
    if targets is not None:
        for m in _found(POINTER, text, ".md#"):
            if f"{m.group('page')}#{m.group('anchor')}" not in targets:
                report(m.start(), "dangling pointer", m.group(0), "no such heading")
    return sorted(set(problems), key=lambda p: (p.line, p.kind, p.text))


def _listed_by_git(root: Path) -> list[str] | None:
    """The repository's files as git sees them (tracked, or untracked and not ignored); None
    when ``root`` is not a git work tree or git is missing."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted({name for name in out.decode(errors="replace").split("\0") if name})


def _walked(root: Path) -> list[str]:
    names: list[str] = []
    for top, dirs, filenames in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        rel = Path(top).relative_to(root)
        names += [str(rel / name) for name in sorted(filenames)]
    return names


def texts(root: Path = ROOT) -> Iterator[tuple[Path, str]]:
    """Every text file of the repository with its text, except those marked not scanned."""
    names = _listed_by_git(root)
    for name in names if names is not None else _walked(root):
        path = root / name
        try:
            data = path.read_bytes()
        except OSError:
            continue  # deleted in the work tree, or not a regular file
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode(errors="replace")
        if NOT_SCANNED in text:
            continue
        yield path, text


def check(root: Path = ROOT) -> list[Problem]:
    known = set(entries((root / "docs" / "requirements.md").read_text()))
    targets = anchors(root)
    problems: list[Problem] = []
    for path, text in texts(root):
        problems += check_text(text, str(path.relative_to(root)), known, targets)
    return problems


def fix(root: Path = ROOT) -> list[Path]:
    """Apply ``fix_text`` to every scanned file; returns the files it changed."""
    known = set(entries((root / "docs" / "requirements.md").read_text()))
    changed: list[Path] = []
    for path, text in texts(root):
        new = fix_text(text, known)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: list[str]) -> int:
    if "--fix" in argv:
        for path in fix():
            print(f"rewritten: {path.relative_to(ROOT)}")
    problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
