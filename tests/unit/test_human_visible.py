"""``daemon.cli.human.visible``: what the views print never carries a control character an agent
wrote; newline and tab stay, CRLF is a newline; errors quoting an agent are escaped too."""

from __future__ import annotations

import io

from daemon.cli.human.errors import error_lines
from daemon.cli.human.term import Term
from daemon.cli.human.transcript import ConversationWriter
from daemon.cli.human.visible import visible, visible_data
from ipc.errors import ErrorCode, IpcError


def test_visible_escapes_controls_but_newline_and_tab() -> None:
    assert visible("plain\ttext\nnext") == "plain\ttext\nnext"
    assert visible("a\x1b[2Jb\x07c\x00\x7f\x9b") == "a\\x1b[2Jb\\x07c\\x00\\x7f\\x9b"
    assert visible("line\r\nnext\rover") == "line\nnext\\x0dover"
    assert visible_data({"k\x1b": ["\x1b", 1, None, {"n": "\x07"}]}) == {"k\\x1b": ["\\x1b", 1, None, {"n": "\\x07"}]}


def test_the_conversation_writer_escapes_chunks_and_the_json_entries_it_decodes() -> None:
    out = io.StringIO()
    writer = ConversationWriter(out, Term(colour=False, width=80), "s")
    writer.entry({"kind": "agent_message_chunk", "text": "hi\x1b]0;owned\x07"})
    writer.entry({"kind": "tool_call", "text": '{"title": "run \\u001b[1A", "status": "pending"}'})
    writer.turn_ended({"state": "finished", "stop_reason": "end\x1b[2J", "error": None})
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert "hi\\x1b]0;owned\\x07" in text and "run \\x1b[1A" in text and "end\\x1b[2J" in text


def test_an_error_quoting_an_agent_is_escaped() -> None:
    error = IpcError(ErrorCode.AGENT_ERROR, "agent failed to start; stderr tail: \x1b]52;c;cm0gLXJmIH4=\x07")
    assert error_lines(error)[0] == "kandev: agent failed to start; stderr tail: \\x1b]52;c;cm0gLXJmIH4=\\x07"
