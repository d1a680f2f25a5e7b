"""``daemon.agentctl.instance.agent_json``: lone surrogates an agent escaped in its JSON become U+FFFD (a
pair stays its character), nesting below ``MAX_DEPTH`` is cut, a line too deep to decode is not
JSON, and the cheap pre-checks find every line that needs a walk. Plus what that buys the
backend: the deepest event the control server passes on is stored like any other."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from daemon.agentctl.instance.agent_json import (
    CUT,
    MAX_DEPTH,
    SURROGATE_ESCAPE,
    clean,
    clean_str,
    decode,
    prune,
)
from daemon.agentctl.instance.events import plain
from daemon.backend.state.events import apply_events
from daemon.store import transcript
from daemon.store.db import Store, sqlite_url
from ipc.client import Event
from tests.support.store_rows import new_session


@pytest.mark.parametrize("escaped, expected", [
    ('"a\\ud800b"', "a\ufffdb"),
    ('"\\udfff"', "\ufffd"),
    ('"\\uDBFF\\uDBFF"', "\ufffd\ufffd"),
    ('"\\ud83d\\ude00"', "\U0001F600"),  # a pair, escaped as ensure_ascii writers do
    ('"\\ude00\\ud83d"', "\ufffd\ufffd"),  # the halves in the wrong order are two lone ones
    ('"x\\ud83d\\ude00\\ud83d"', "x\U0001F600\ufffd"),
    ('"plain \\u00e9"', "plain \u00e9"),
])
def test_lone_surrogates_become_replacement_characters_and_pairs_stay(escaped: str, expected: str) -> None:
    line = escaped.encode()
    assert (SURROGATE_ESCAPE.search(line) is not None) == ("\\ud" in escaped.lower())
    assert clean_str(json.loads(escaped)) == expected
    assert decode(line) == expected


def test_clean_walks_keys_values_and_lists_and_leaves_other_types() -> None:
    value = json.loads('{"k\\ud800":[1, 2.5, true, null, "v\\udc00", {"n": "\\ud800"}], "big": 123456789012345678901234}')
    cleaned = clean(value)
    assert cleaned == {"k\ufffd": [1, 2.5, True, None, "v\ufffd", {"n": "\ufffd"}], "big": 123456789012345678901234}
    msgpack.packb(cleaned["k\ufffd"])  # encodable now


def test_plain_makes_an_event_with_lone_surrogates_and_huge_integers_encodable() -> None:
    data = {"update": {"text\udc80": "cut \ud83d", "n": 2**70}}
    with pytest.raises(UnicodeEncodeError):
        msgpack.packb(data)
    assert msgpack.unpackb(msgpack.packb(plain(data))) == {"update": {"text\ufffd": "cut \ufffd", "n": str(2**70)}}


def _nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def test_nesting_is_kept_to_max_depth_and_cut_below() -> None:
    assert decode(_nested(MAX_DEPTH).encode()) == json.loads(_nested(MAX_DEPTH))  # at the limit: whole
    cut = decode(_nested(MAX_DEPTH + 5).encode())
    for _ in range(MAX_DEPTH):
        cut = cut["a"]
    assert cut == CUT
    assert prune([[1], {"x": [2]}], MAX_DEPTH - 1) == [CUT, CUT]


def test_many_brackets_side_by_side_are_not_deep() -> None:
    wide = json.dumps([[i] for i in range(5 * MAX_DEPTH)])
    assert decode(wide.encode()) == json.loads(wide)


@pytest.mark.parametrize("line", [b"[" * 100_000 + b"]" * 100_000, b"not json", b'{"a":1} x', b"\xff"])
def test_what_is_not_json_or_too_deep_to_decode_is_a_value_error(line: bytes) -> None:
    with pytest.raises(ValueError):
        decode(line)


def test_the_deepest_event_the_control_server_passes_on_is_stored(tmp_path: Path) -> None:
    """Nested ~950 deep, a ``config_option_update`` made the session metadata's JSON encoder (and
    the error's own repr) exceed the recursion limit: the batch failed at every retry. Decoded as
    the control server decodes them (cut at ``MAX_DEPTH``), such events are applied like any other."""
    deep = "[" * 900 + "]" * 900  # json.loads decodes it; the backend's encoders fail near 950

    def agent_line(update: str) -> bytes:
        return ('{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":' + update + "}}").encode()

    updates = [
        decode(agent_line('{"sessionUpdate":"tool_call","toolCallId":"t","rawInput":' + deep + "}")),
        decode(agent_line('{"sessionUpdate":"config_option_update","configOptions":[{"id":"x","currentValue":' + deep + "}]}")),
    ]
    store = Store.open(sqlite_url(tmp_path / "kandev.db"))
    try:
        sid = new_session(store)
        with store.session() as db:
            apply_events(db, sid, "i1", [Event(seq, "session_update", {"turn_id": None, "update": m["params"]["update"]})
                                         for seq, m in enumerate(updates, start=1)])
        with store.session() as db:
            kinds = [c.kind for c in transcript.chunks_after(db, sid, 0)]
        assert kinds == ["tool_call", "config_option_update"]
    finally:
        store.close()
