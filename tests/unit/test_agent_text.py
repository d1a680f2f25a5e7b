"""``daemon.agentctl.agent_text``: lone surrogates an agent escaped in its JSON become U+FFFD, a
pair stays its character, and the transport's cheap pre-check finds every escape that can make one."""

from __future__ import annotations

import json

import msgpack
import pytest

from daemon.agentctl.agent_text import SURROGATE_ESCAPE, clean, clean_str
from daemon.agentctl.events import plain


@pytest.mark.parametrize("escaped, expected", [
    ('"a\\ud800b"', "a\ufffdb"),
    ('"\\udfff"', "\ufffd"),
    ('"\\uDBFF\\uDBFF"', "\ufffd\ufffd"),
    ('"\\ud83d\\ude00"', "\U0001F600"),  # a pair, escaped as ensure_ascii writers do
    ('"\\ude00\\ud83d"', "\ufffd\ufffd"),  # the halves in the wrong order are two lone ones
    ('"x\\ud83d\\ude00\\ud83d"', "x\U0001F600\ufffd"),
    ('"plain \\u00e9"', "plain \u00e9"),
])
def test_clean_str_replaces_each_lone_surrogate_and_keeps_pairs(escaped: str, expected: str) -> None:
    line = escaped.encode()
    assert (SURROGATE_ESCAPE.search(line) is not None) == ("\\ud" in escaped.lower())
    assert clean_str(json.loads(escaped)) == expected


def test_clean_walks_keys_values_and_lists_and_leaves_other_types() -> None:
    value = json.loads('{"k\\ud800":[1, 2.5, true, null, "v\\udc00", {"n": "\\ud800"}], "big": 123456789012345678901234}')
    cleaned = clean(value)
    assert cleaned == {"k\ufffd": [1, 2.5, True, None, "v\ufffd", {"n": "\ufffd"}], "big": 123456789012345678901234}
    msgpack.packb(cleaned["k\ufffd"])  # encodable now


def test_plain_makes_an_event_with_lone_surrogates_encodable() -> None:
    data = {"update": {"text\udc80": "cut \ud83d"}}
    with pytest.raises(UnicodeEncodeError):
        msgpack.packb(data)
    assert msgpack.unpackb(msgpack.packb(plain(data))) == {"update": {"text\ufffd": "cut \ufffd"}}
