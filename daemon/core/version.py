"""Kandev's version: the one place it is written.

``VERSION`` is what this process runs. pyproject.toml reads it (``dynamic``), the backend reports
it, both daemons introduce themselves to agents with it, and a unit test checks that
``debian/changelog`` and the man pages say the same. Releases are tagged ``v<VERSION>`` in git;
``packaging/releases.txt`` records each released version's commit for clones without tags.

``installed_version()`` is what the *next* process would run: it reads this file from disk again
instead of trusting the imported constant, so a process that was started before a package upgrade
replaced its files can tell that it is older than what is installed (``kandev status``).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from pathlib import Path

VERSION = "0.4.0"

_ASSIGNMENT = r'^VERSION = "([^"\n]{1,64})"$'  # re, imported by the functions: `kandev --version` needs neither


def installed_version(path: Path | None = None) -> str | None:
    """The version written in this module's file as it is on disk now; None if unreadable."""
    try:
        with open(__file__ if path is None else path, encoding="utf-8") as source:  # no pathlib: see TYPE_CHECKING
            text = source.read()
    except (OSError, UnicodeDecodeError):
        return None
    import re

    match = re.search(_ASSIGNMENT, text, re.MULTILINE)
    return match.group(1) if match else None


def version_key(version: str) -> tuple[int, ...]:
    """``"0.2.0"`` -> ``(0, 2, 0)`` for ordering (a suffix such as ``+test1`` or ``~rc1`` is ignored)."""
    import re

    numbers: list[int] = []
    for part in re.split(r"[.]", re.split(r"[+~-]", version, maxsplit=1)[0]):
        if not part.isdigit():
            break
        numbers.append(int(part))
    return tuple(numbers)
