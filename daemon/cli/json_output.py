"""One JSON object as ``kandev --json`` prints it: ``json.dumps(obj, sort_keys=True, default=str)``,
character for character, without importing ``json``.

The ``json`` package imports ``re`` (and with it ``enum``): about half of the interpreter's own
start, for every CLI call. ``json.dumps`` with these arguments and no indent is the C encoder of
``_json``, the standard library's accelerator module, called with the same arguments; this module
calls it directly. Where that module is missing (another interpreter), it is ``json.dumps`` itself.
tests/unit/test_cli_json.py compares both on awkward values.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import Any

    from ipc.errors import IpcError


def json_line(obj: Any) -> str:
    """``obj`` as ``json.dumps(obj, sort_keys=True, default=str)`` spells it."""
    try:
        from _json import encode_basestring_ascii, make_encoder
    except ImportError:
        import json

        return json.dumps(obj, sort_keys=True, default=str)
    if isinstance(obj, str):  # what JSONEncoder.encode does for a bare string
        return encode_basestring_ascii(obj)
    # JSONEncoder.iterencode's own call for indent=None, check_circular=True (markers), allow_nan=True,
    # skipkeys=False and its default separators
    encode = make_encoder({}, str, encode_basestring_ascii, None, ": ", ", ", True, False, True)
    return "".join(encode(obj, 0))


def print_json_error(exc: IpcError) -> None:
    """A refused or failed call under ``--json``: ``{"error": ...}`` on stdout, one line on stderr."""
    print(json_line({"error": exc.to_wire()}))
    print(f"kandev: {exc.code}: {exc.message}", file=sys.stderr)
