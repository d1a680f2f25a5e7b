"""daemon.cli.human: colour and width rules, tables, the status summary (tolerant of fields other
features add), errors with hints, and transcripts as conversations. The real CLI against a real
backend is in tests/integration/test_cli_human.py (Issue 14 scenario A, Issue 14 scenario B, Issue 14 scenario C, Issue 14 scenario D and Issue 14 scenario E)."""

from __future__ import annotations

import io
import json
from typing import Any

from daemon.cli.human.errors import error_lines
from daemon.cli.human.fmt import age, unique_length
from daemon.cli.human.status import render_status
from daemon.cli.human.table import render_table
from daemon.cli.human.term import Term
from daemon.cli.human.transcript import ConversationWriter
from daemon.cli.human.views import agentctl_reload_lines, session_list_lines, session_show
from ipc.errors import ErrorCode, IpcError


class _Tty(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def test_colour_only_on_a_terminal_without_no_color() -> None:
    """Issue 14 scenario E (rules): a pipe, NO_COLOR (any value) or TERM=dumb: no colour."""
    assert Term.for_stream(_Tty(), {"TERM": "xterm"}).colour is True
    assert Term.for_stream(_Tty(), {"TERM": "xterm", "NO_COLOR": "1"}).colour is False
    assert Term.for_stream(_Tty(), {"NO_COLOR": ""}).colour is False
    assert Term.for_stream(_Tty(), {"TERM": "dumb"}).colour is False
    piped = Term.for_stream(io.StringIO(), {"TERM": "xterm"})
    assert piped.colour is False and piped.width is None  # into a pipe lines are never cut
    assert Term(colour=False).red("x") == "x" and Term(colour=True).red("x") == "\x1b[31mx\x1b[0m"


def test_tables_align_and_give_way_on_narrow_terminals() -> None:
    rows = [["1a2b3c4d", "a rather long title that does not fit", "RUNNING"], ["5e6f", "short", "FAILED"]]
    wide = render_table(Term(), ["TASK", "TITLE", "STATE"], rows, flex=1)
    assert wide[0].split() == ["TASK", "TITLE", "STATE"]
    assert wide[1].index("RUNNING") == wide[2].index("FAILED") == wide[0].index("STATE")
    narrow = render_table(Term(width=40), ["TASK", "TITLE", "STATE"], rows, flex=1)
    assert all(len(line) <= 40 for line in narrow) and "\u2026" in narrow[1]


def test_flexible_columns_give_way_in_the_order_given() -> None:
    """Issue 46 Why 6: the first flexible column gives way down to its minimum, then the next; the
    other columns (ids, a state) stay whole."""
    rows = [["1a2b3c4d", "a title of some thirty characters", "WAITING_FOR_INPUT", "#12 end_turn 3m ago"]]
    headers = ["TASK", "TITLE", "STATE", "LAST TURN"]
    wide = render_table(Term(), headers, rows, flex=(3, 1))
    full = len(wide[1])
    lines = render_table(Term(width=full - 5), headers, rows, flex=(3, 1))
    assert "a title of some thirty characters" in lines[1] and "#12 end_turn 3m ago" not in lines[1]
    lines = render_table(Term(width=60), headers, rows, flex=(3, 1))
    assert all(len(line) <= 60 for line in lines), lines
    assert lines[1].split()[:1] == ["1a2b3c4d"] and "WAITING_FOR_INPUT" in lines[1] and "LAST TURN" in lines[0]


def test_ids_are_shown_long_enough_to_tell_apart() -> None:
    assert unique_length(["1a2b3c4d00", "99"]) == 8
    assert unique_length(["1a2b3c4d00", "1a2b3c4d11"]) == 9


def test_status_shows_warnings_first_and_every_field_it_does_not_know() -> None:
    """Other features add fields (control_server.state may be any string, last-loss details, new
    sections): they are shown, nothing breaks."""
    status: dict[str, Any] = {
        "backend": {"pid": 10, "version": "0.2.0", "socket": "/h/run/backend.sock", "home": "/h", "state": "ready"},
        "capability": {"state": "enabled", "reason": None, "detail": "on", "supervisor": "systemd"},
        "control_server": {"state": "gave_up", "pid": None, "mode": "unit", "version": "0.1.9",
                           "last_loss": {"at": "2026-01-01T00:00:00+00:00", "reason": "exited 9"}},
        "recovery": {"retracked": 2, "not_retracked": 1, "reasons": {"ab" * 16: "instance_missing"},
                     "stopped_orphans": 0, "duration_ms": 1234.5},
        "adoption": {"outcome": "adopted", "reason": None},
        "sandbox": {"mode": "required", "available": True},
    }
    lines = render_status(status, Term())
    text = "\n".join(lines)
    assert lines[0].startswith("\u25cf kandev-backend: ready (pid 10, version 0.2.0)")
    assert "control server is gave_up" in lines[1] and "could not be re-tracked" in lines[2]
    for shown in ("gave_up, unit mode, version 0.1.9", "last lost at 2026-01-01T00:00:00+00:00: exited 9",
                  "Sandbox: mode: required", "available: yes", "session abababab not re-tracked: instance_missing",
                  "took 1.2 s"):
        assert shown in text, shown
    assert not any(line.lstrip().startswith(("{", "[")) for line in lines)


def test_status_warns_when_agents_are_not_sandboxed() -> None:
    """Issue 10: an unsandboxed agent is something to see first (off, or a sandbox that cannot be made)."""
    base: dict[str, Any] = {"backend": {"pid": 1, "version": "0.1.0", "state": "ready"}}
    ok = {**base, "sandbox": {"policy": "required", "sandboxed": True, "available": True, "reason": None}}
    assert not any("Warning" in line for line in render_status(ok, Term()))
    off = {**base, "sandbox": {"policy": "off", "sandboxed": False, "reason": 'agents.sandbox = "off"'}}
    assert 'agents are not sandboxed: agents.sandbox = "off"' in render_status(off, Term())[1]


def test_status_warns_while_the_database_server_is_unreachable() -> None:
    """Issue 47 item 5: an unreachable store is a warning in words, with since when and why; the
    store's block does not repeat it as raw fields."""
    base: dict[str, Any] = {"backend": {"pid": 1, "version": "0.1.0", "state": "ready"}}
    ok = {**base, "store": {"reachable": True, "unreachable_since": None, "unreachable": None}}
    assert not any("Warning" in line for line in render_status(ok, Term()))
    gone = {**base, "store": {"reachable": False, "unreachable_since": 1796600000.5, "unreachable": {
        "since": 1796600000.5, "seconds": 12.3, "detail": "OperationalError: connection is bad", "attempts": 7}}}
    lines = render_status(gone, Term())
    assert "store unreachable since 2026-12-06 " in lines[1] and "(12 s)" in lines[1], lines
    assert "connection is bad" in lines[1] and "nothing is lost" in lines[1]
    assert not any("unreachable_since" in line or "unreachable.detail" in line for line in lines), lines


def test_an_ambiguous_id_error_lists_the_candidates_and_a_hint() -> None:
    err = IpcError(ErrorCode.AMBIGUOUS_ID, "x", False,
                   {"kind": "task", "given": "abcd", "candidates": ["abcd1", "abcd2"], "total": 2})
    assert error_lines(err) == ["kandev: task id 'abcd' is ambiguous; it is the start of 2 tasks:",
                                "  abcd1", "  abcd2", "hint: give more characters of the id"]
    down = error_lines(IpcError(ErrorCode.UNAVAILABLE, "cannot connect to /h/run/backend.sock"))
    assert down[0] == "kandev: cannot connect to /h/run/backend.sock" and "kandev up" in down[1]
    missing = error_lines(IpcError(ErrorCode.CONFLICT, "session 1 has no running agent (state FAILED)"), "prompt",
                          "1a2b")
    assert missing[-1] == "hint: `kandev resume 1a2b` gives the session an agent again"


def _entry(kind: str, text: str, turn: str | None = "t:1", role: str = "agent") -> dict[str, Any]:
    return {"kind": kind, "text": text, "turn_id": turn, "role": role}


def test_the_conversation_joins_chunks_and_puts_events_on_lines_of_their_own() -> None:
    out = io.StringIO()
    w = ConversationWriter(out, Term(), "5e55" + "0" * 28, live=True)
    w.entry(_entry("prompt", "/permission", role="user"))
    w.entry(_entry("agent_message_chunk", "thinking about "))
    w.entry(_entry("agent_message_chunk", "it"))
    w.entry(_entry("tool_call", json.dumps({"sessionUpdate": "tool_call", "title": "Read file", "kind": "read",
                                            "status": "pending"})))
    w.entry(_entry("permission_request", json.dumps({"request_id": "77aa" * 8, "tool_call": {"title": "Run ls"},
                                                     "options": [{"optionId": "allow"}, {"optionId": "reject"}]}),
                   role="system"))
    w.entry(_entry("available_commands_update", "{}"))
    w.turn_ended({"state": "finished", "stop_reason": "end_turn"})
    assert out.getvalue().splitlines() == [
        "> /permission",
        "thinking about it",
        "[tool] Read file (read, pending)",
        "[permission 77aa77aa] Run ls - options: allow, reject",
        "  answer: kandev permission 5e550000 77aa77aa --option allow (or --cancel)",
        "[turn ended: end_turn]",
    ]


def test_session_show_reads_as_a_conversation_turn_by_turn() -> None:
    show = {
        "session_id": "5e55" + "0" * 28, "task_id": "7a5c" + "0" * 28, "state": "WAITING_FOR_INPUT", "agent": "mock",
        "agent_pid": 42, "live": True, "retracked": True, "runtime_config": {"model": "m1", "mode": "code",
                                                                             "options": {}},
        "turns": [{"turn_id": "t:1", "state": "finished", "stop_reason": "end_turn"},
                  {"turn_id": "t:2", "state": "finished", "stop_reason": "cancelled"}],
        "turns_total": 2, "permissions": [], "page": {"more_before": False, "more_after": False, "count": 5,
                                                       "total": 5},
        "transcript": [_entry("prompt", "hello", "t:1", "user"), _entry("agent_message_chunk", "echo: hello", "t:1"),
                       _entry("prompt", "/slow 3", "t:2", "user"), _entry("agent_message_chunk", "1/3 ", "t:2"),
                       _entry("agent_message_chunk", "2/3 ", "t:2")],
    }
    out = io.StringIO()
    session_show(show, Term(), out, "fix the bug")
    lines = out.getvalue().splitlines()
    assert lines[0] == "\u25cf Session 5e550000 of task 7a5c0000 'fix the bug'"
    assert any("re-tracked" in line and "WAITING_FOR_INPUT" in line for line in lines)
    assert "Model/mode: m1 / code" in out.getvalue() and "mock, pid 42" in out.getvalue()
    body = lines[lines.index("-- turn 1 --"):]
    assert body == ["-- turn 1 --", "> hello", "echo: hello", "[turn ended: end_turn]", "",
                    "-- turn 2 --", "> /slow 3", "1/3 2/3 ", "[turn cancelled]"]


def test_session_list_hides_finished_sessions_unless_all() -> None:
    rows = [{"session_id": f"{c}" * 32, "task_id": "7" * 32, "task_title": "t", "agent": "mock", "state": state,
             "retracked": False, "live": state == "RUNNING", "created_at": None, "last_turn": None}
            for c, state in (("1", "RUNNING"), ("2", "COMPLETED"), ("3", "FAILED"))]
    lines = session_list_lines({"sessions": rows}, Term(), show_all=False)
    assert lines[0].split() == ["SESSION", "TASK", "TITLE", "AGENT", "STATE", "AGE", "LAST", "TURN"]
    assert [line.split()[0] for line in lines[1:3]] == ["11111111", "33333333"]
    assert "1 finished session not shown" in lines[-1]
    assert len(session_list_lines({"sessions": rows}, Term(), show_all=True)) == 4


def test_ages_read_like_kubectl() -> None:
    from datetime import UTC, datetime

    now = datetime(2026, 1, 2, tzinfo=UTC)
    assert age("2026-01-01T23:59:15+00:00", now) == "45s"
    assert age("2026-01-01T23:00:00+00:00", now) == "60m"
    assert age("2026-01-01T00:00:00+00:00", now) == "24h"
    assert age(None, now) == "-"


def test_status_shows_versions_and_re_executions_beside_the_link_state() -> None:
    """Issue 15 with Issue 11 and Issue 14: the control server block says what runs and what is installed,
    how often it re-executed in place and how the last reload ended, next to its link's state; an
    outdated server or one waiting to be replaced is a warning; reloading is not."""
    base: dict[str, Any] = {"backend": {"pid": 1, "version": "0.2.0", "state": "ready"}}
    server = {"state": "running", "pid": 7, "mode": "unit", "version": "0.2.0", "installed_version": "0.2.0",
              "protocol_version": [1, 1], "can_reload": True, "reexec_count": 3,
              "last_reexec_at": "2026-12-01T06:00:00+00:00", "restarts": 1,
              "last_reload": {"attempt": 3, "outcome": "reexecuted", "reason": None, "at": "2026-12-01T06:00:00+00:00"},
              "replacement": None, "last_replaced": None}
    lines = render_status({**base, "control_server": server}, Term())
    text = "\n".join(lines)
    assert not any("Warning" in line for line in lines), text
    for shown in ("running, unit mode, pid 7, version 0.2.0", "installed version 0.2.0",
                  "re-executed in place 3 times, last at 2026-12-01T06:00:00+00:00", "restarted 1 time after a loss"):
        assert shown in text, shown
    assert "reexec_count" not in text and "last_reload" not in text  # shown as sentences, not as fields

    reloading = render_status({**base, "control_server": {**server, "state": "reloading"}}, Term())
    assert not any("Warning" in line for line in reloading)

    refused = {**server, "installed_version": "0.2.1",
               "last_reload": {"attempt": 4, "outcome": "refused", "reason": "preflight failed", "at": "x"}}
    text = "\n".join(render_status({**base, "control_server": refused}, Term()))
    assert ("the control server runs version 0.2.0, 0.2.1 is installed (the last reload was refused:"
            " preflight failed): `kandev agentctl reload` runs it") in text
    assert "last reload (attempt 4) refused at x: preflight failed" in text

    old = {"state": "running", "pid": 9, "mode": "detached", "version": None, "installed_version": "0.2.0",
           "protocol_version": [1, 0], "can_reload": False, "replacement": "when_idle"}
    text = "\n".join(render_status({**base, "control_server": old}, Term()))
    assert "the control server predates in-place reload: version 0.2.0 replaces it once it runs no instance" in text
    assert "cannot re-execute in place (protocol 1.0); replaced once it runs no instance" in text


def test_agentctl_reload_reads_as_a_sentence() -> None:
    """``kandev agentctl reload`` without --json: no JSON, what ran before and after."""
    result = {"attempt": 2, "outcome": "reexecuted", "reason": None, "pid": 7, "pid_before": 7,
              "version_before": "0.2.0", "version": "0.2.1", "installed_version": "0.2.1", "reexec_count": 2,
              "pause_ms": 812.4}
    assert agentctl_reload_lines(result, Term()) == [
        "Control server re-executed in place: version 0.2.0 -> 0.2.1 (pid 7, same process; every agent kept running)",
        "  paused 812 ms; re-executions in this server's life: 2",
    ]
    assert "reload again" in agentctl_reload_lines({**result, "installed_version": "0.2.2"}, Term())[-1]
    refused = error_lines(IpcError("reload_refused", "the control server refused to reload: x"), "agentctl")
    assert refused[0] == "kandev: the control server refused to reload: x" and "KANDEV_EVENT=reload_refused" in refused[1]


def test_status_tells_the_link_story_in_sentences_not_fields() -> None:
    """Issue 11 with Issue 14: losses, restarts, the crash-loop limit and giving up read as sentences;
    the passthrough server gets one line of its own; no raw ``name.key: value`` dump of link fields."""
    server = {"state": "gave_up", "pid": None, "mode": "unit", "version": "0.2.0", "restarts": 4,
              "replacements": 0, "losses_in_window": 5, "crash_loop": {"limit": 5, "window_s": 300.0},
              "last_loss": {"at": "2026-12-01T06:00:05Z", "reason": "exited 3", "at_start": True},
              "gave_up": {"at": "2026-12-01T06:00:05Z", "reason": "exited 3", "at_start": True},
              "passthrough": {"state": "running", "pid": 42, "restarts": 0, "losses_in_window": 0,
                              "crash_loop": {"limit": 5, "window_s": 300.0}, "last_loss": None, "gave_up": None}}
    lines = render_status({"backend": {"pid": 1, "version": "0.2.0", "state": "ready"}, "control_server": server},
                          Term())
    text = "\n".join(lines)
    assert "restarted 4 times after a loss; 5 losses in the last 300.0 s (gives up at 5)" in text
    assert "gave up at 2026-12-01T06:00:05Z: exited 3 (`kandev up` tries again)" in text
    assert "passthrough server: running, pid 42" in text
    for raw in ("losses_in_window", "crash_loop", "passthrough.", "gave_up.", "last_loss."):
        assert raw not in text, raw


def test_an_agents_stderr_is_shown_without_its_control_sequences() -> None:
    """Issue 23 item 4: `kandev logs` never lets the agent's bytes drive the terminal."""
    from daemon.cli.human.views import log_text

    shown = log_text("ok\tfine\n\x1b[2J\x1b]0;title\x07\x9bx\n", Term(colour=False, width=None))
    assert shown == "ok\tfine\n\\x1b[2J\\x1b]0;title\\x07\\x9bx\n"


def test_a_mistyped_command_gets_the_closest_one() -> None:
    """Issue 23 item 4: "did you mean" for commands and subcommands, the choices otherwise."""
    from daemon.cli.parser import did_you_mean

    m = "argument command: invalid choice: 'sesion' (choose from 'up', 'down', 'session', 'status')"
    assert did_you_mean(m) == "unknown command 'sesion'; did you mean 'session'?"
    m = "argument command: invalid choice: 'zz' (choose from 'up', 'down')"
    assert did_you_mean(m) == "unknown command 'zz'; one of: up, down"
    m = "argument --executor: invalid choice: 'wt' (choose from 'local', 'worktree')"
    assert did_you_mean(m).startswith("--executor: 'wt' is not a choice")
    assert did_you_mean("the following arguments are required: --title") == \
        "the following arguments are required: --title"


def test_the_board_places_tasks_that_need_their_user_with_a_reason() -> None:
    """Issue 23 item 3: permission, failed (session or turn), cancelled, no agent; done wins."""
    from daemon.store.board import placement
    from daemon.store.states import Attention

    assert placement("in_progress", "RUNNING", live=True, open_permission=True) == (
        "needs_attention", Attention.PERMISSION)
    assert placement("in_progress", "RUNNING", live=True) == ("running", None)
    assert placement("review", "WAITING_FOR_INPUT", live=True, last_stop_reason="error") == (
        "needs_attention", Attention.FAILED)
    assert placement("review", "WAITING_FOR_INPUT", live=True, last_stop_reason="end_turn") == ("turn_finished", None)
    # a turn its dead agent abandoned stops counting once the session was resumed with a live agent
    assert placement("review", "WAITING_FOR_INPUT", live=True, last_stop_reason="agent_exited") == (
        "turn_finished", None)
    assert placement("review", "WAITING_FOR_INPUT", live=False, last_stop_reason="agent_exited") == (
        "needs_attention", Attention.FAILED)
    assert placement("review", "WAITING_FOR_INPUT", live=False) == ("needs_attention", Attention.NO_AGENT)
    assert placement("review", "WAITING_FOR_INPUT", live=None) == ("turn_finished", None)  # recovery holds it
    assert placement("review", "FAILED", live=False) == ("needs_attention", Attention.FAILED)
    assert placement("review", "CANCELLED", live=False) == ("needs_attention", Attention.CANCELLED)
    assert placement("done", "WAITING_FOR_INPUT", live=False) == ("done", None)
    assert placement("backlog", None, live=None) == ("backlog", None)


def test_a_provider_authentication_failure_names_the_agents_secret_env() -> None:
    """Issue 23 item 3 (Why 8): Claude Code's "Authentication required" hints at its secret_env."""
    from daemon.store.board import attention_hint
    from daemon.store.states import Attention

    for error in ("Authentication required", "Invalid API key · Please run /login", "401 Unauthorized"):
        hint = attention_hint(Attention.FAILED, "claude-code", error)
        assert hint is not None and "agents.claude-code.secret_env" in hint, error
    assert attention_hint(Attention.FAILED, "mock", 'Internal error ({"details": "mock /fail"})') is None
    assert attention_hint(Attention.NO_AGENT, "claude-code", "Authentication required") is None
