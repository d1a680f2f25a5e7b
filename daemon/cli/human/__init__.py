"""What ``kandev`` prints for people when ``--json`` is not given.

``term`` decides colour and width for a stream; ``table`` lays out aligned columns; ``status``,
``views`` and ``transcript`` render the results of the backend ops; ``errors`` turns a typed
error into ``kandev: <what went wrong>`` plus a hint; ``follow`` is the client of the backend's
``follow`` stream (reconnecting across backend restarts). Nothing here changes ``--json`` output.

``kandev`` imports these modules only for the commands that print for people; this package's own
import is kept free of them (the parser needs only ``RECONNECT_TIMEOUT_S`` and
``terminal_columns``). None of them imports ``typing``, ``dataclasses`` or ``shutil``: a CLI call is
a whole interpreter start, and those three cost a call for people ~20 ms of imports
(tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

import os
import sys

RECONNECT_TIMEOUT_S = 60.0  # how long follow waits for a lost backend by default


def terminal_columns(fallback: int) -> int:
    """What ``shutil.get_terminal_size((fallback, ...)).columns`` says: ``$COLUMNS``, else the
    terminal on standard output, else ``fallback``; without importing shutil (which imports bz2,
    lzma and fnmatch)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 0
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or fallback
