"""``kandev --json`` output without the json package (daemon/cli/json_output.py, Issue 24 item 3): the
standard library's C encoder called as ``json.dumps(obj, sort_keys=True, default=str)`` calls it,
character for character, refusing what json.dumps refuses."""

from __future__ import annotations

import json
import math

import pytest

from daemon.cli.json_output import json_line

VALUES = [
    {"b": 1, "a": [1, 2.5, -0.0, 1e300, 10**40, -(10**40)], "c": None, "d": True, "e": False},
    {"nested": {"z": {"y": [{"x": [[], {}]}]}}, "": ""},
    "a bare string with \"quotes\", \\ and \x00\x1b[31m control",
    "é ü 漢字 \U0001F600 \u2028\u2029 \ud800 lone surrogate",
    42, 2.5, None, True, [], {}, (1, 2),
    {"nan": math.nan, "inf": math.inf, "-inf": -math.inf},
    {"object": object, "set": {1}, "bytes": b"\xff"},  # default=str
    {2: "int key", 1: "int key"}, {2.5: "float key", 1.5: "float key"},
    {"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
]


@pytest.mark.parametrize("value", VALUES)
def test_a_value_is_spelled_as_json_dumps_spells_it(value: object) -> None:
    assert json_line(value) == json.dumps(value, sort_keys=True, default=str)


@pytest.mark.parametrize("value", [{"a": 1, 2: "mixed keys do not sort"}, [1, {"a": []}]], ids=["mixed", "cycle"])
def test_what_json_dumps_refuses_is_refused(value: object) -> None:
    if isinstance(value, list):
        value[1]["a"].append(value)  # type: ignore[index]
    with pytest.raises(Exception) as dumps_error:
        json.dumps(value, sort_keys=True, default=str)
    with pytest.raises(type(dumps_error.value)):
        json_line(value)
