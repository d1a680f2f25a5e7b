"""A session's transcript as a conversation, for ``kandev session show`` and ``kandev follow``.

Prompts start with ``> ``; the agent's text chunks are joined as a person reads them (written as
they come, no line break between chunks); its thoughts are dimmed; tool calls, permission
requests (with the command that answers them), permission answers, errors and other events each
get a line of their own in brackets; each turn ends with a line giving its stop reason.
"""

from __future__ import annotations

import json
from enum import Enum

from daemon.cli.human.fmt import short, stop_reason_ok
from daemon.cli.human.term import Colour, Term
from daemon.cli.human.visible import visible_data
from daemon.store.states import TurnState

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import IO, Any

_QUIET_KINDS = frozenset({"available_commands_update"})  # noise for a person: not shown


class Run(Enum):
    """What the current line holds (chunks of one kind are joined on one line)."""

    NONE = "none"
    TEXT = "text"
    THOUGHT = "thought"
    USER = "user"


def _json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (ValueError, TypeError):
        return {}
    return visible_data(data) if isinstance(data, dict) else {}  # the agent's strings, decoded: made visible


def turn_end_line(term: Term, outcome: dict[str, Any]) -> str:
    """``[turn ended: end_turn]``, coloured by how it ended."""
    state, reason, error = outcome.get("state"), outcome.get("stop_reason"), outcome.get("error")
    if stop_reason_ok(state, reason, error):
        return term.green(f"[turn ended: {reason}]")
    if reason == "cancelled":
        return term.yellow("[turn cancelled]")
    if reason == "stopped":  # kandev session stop ended it with the agent
        return term.yellow("[turn stopped]")
    verb = "failed" if state == TurnState.ABANDONED or error else "ended"
    if reason == "interrupted" and error:  # why, e.g. "the backend stopped and survival is off"
        return term.red(f"[turn {verb}: interrupted: {error}]")
    text = f"[turn {verb}: {reason or state or 'unknown'}]"
    if error:
        text += f" {error}"
    return term.red(text)


class ConversationWriter:
    """Writes transcript entries to ``out`` as a conversation; ``live`` flushes after every write."""

    def __init__(self, out: IO[str], term: Term, session_id: str, *, live: bool = False,
                 open_requests: set[str] | None = None) -> None:
        self.out = out
        self.term = term
        self.session_id = session_id
        self.live = live
        # session show: the requests still open (only those get the command that answers them);
        # follow (None): every request is open when it arrives.
        self.open_requests = open_requests
        self.run = Run.NONE

    # -- output ----------------------------------------------------------------

    def _write(self, text: str) -> None:
        self.out.write(text)
        if self.live:
            self.out.flush()

    def end_run(self) -> None:
        """Finish the line a run of chunks is on."""
        if self.run is not Run.NONE:
            self._write("\n")
            self.run = Run.NONE

    def line(self, text: str) -> None:
        self.end_run()
        self._write(text + "\n")

    def _chunk(self, run: Run, text: str, prefix: str = "") -> None:
        if self.run is not run:
            self.end_run()
            if prefix:
                self._write(prefix)
            self.run = run
        if run is Run.THOUGHT:
            text = self.term.dim(text)
        self._write(text)

    # -- entries ---------------------------------------------------------------

    def entry(self, e: dict[str, Any]) -> None:
        e = visible_data(e)  # follow hands entries over as they arrive
        kind, text = str(e.get("kind") or ""), str(e.get("text") or "")
        t = self.term
        if kind == "prompt":
            first, *rest = text.split("\n") or [""]
            self.line(t.paint("> ", Colour.CYAN, Colour.BOLD) + t.bold(first) + "".join("\n  " + t.bold(r) for r in rest))
        elif kind == "agent_message_chunk":
            self._chunk(Run.TEXT, text)
        elif kind == "agent_thought_chunk":
            self._chunk(Run.THOUGHT, text, t.dim("(thinking) "))
        elif kind == "user_message_chunk":
            self._chunk(Run.USER, text, t.cyan("> "))
        elif kind in ("tool_call", "tool_call_update"):
            self._tool(kind, _json(text))
        elif kind == "permission_request":
            self._permission_request(_json(text), e.get("open"))
        elif kind in ("permission_response", "permission_cancelled"):
            data = _json(text)
            answer = data.get("option_id") if kind == "permission_response" else None
            self.line(t.magenta(f"[permission {short(str(data.get('request_id') or ''))} "
                                f"{'answered: ' + str(answer) if answer else 'cancelled'}]"))
        elif kind == "agent_error":
            self.line(t.red(f"[agent error] {_json(text).get('message') or text}"))
        elif kind in ("agent_exited", "agent_killed"):
            self.line(t.red(f"[{text}]"))
        elif kind == "turn_timeout":  # the backend ended the turn for its agent's silence
            self.line(t.red(f"[timeout: {text}]"))
        elif kind == "plan":
            self._plan(_json(text))
        elif kind == "current_mode_update":
            self.line(t.dim(f"[mode: {_json(text).get('currentModeId')}]"))
        elif kind == "config_option_update":
            options = _json(text).get("configOptions") or []
            pairs = ", ".join(f"{o.get('id')}={o.get('currentValue')}" for o in options if isinstance(o, dict))
            self.line(t.dim(f"[options: {pairs}]"))
        elif kind in ("session_resumed", "context_reset", "context_reset_failed"):
            data = _json(text)
            detail = data.get("error") or data.get("origin") or ("fresh" if data.get("fresh") else "")
            words = kind.replace("_", " ")
            painted = t.red if kind.endswith("failed") else t.dim
            self.line(painted(f"[{words}{': ' + str(detail) if detail else ''}]"))
        elif kind in _QUIET_KINDS:
            return
        else:
            self.line(t.dim(t.line(f"[{kind}] {text}")))

    def _tool(self, kind: str, data: dict[str, Any]) -> None:
        title = data.get("title") or data.get("toolCallId") or "tool call"
        status = data.get("status")
        if kind == "tool_call_update" and not status and not data.get("title"):
            return  # an update that only carries content: nothing a person needs here
        extra = ", ".join(str(v) for v in (data.get("kind") if kind == "tool_call" else None, status) if v)
        self.line(self.term.yellow(f"[tool] {title}" + (f" ({extra})" if extra else "")))

    def _permission_request(self, data: dict[str, Any], still_open: bool | None) -> None:
        t = self.term
        request = str(data.get("request_id") or "")
        raw_tool = data.get("tool_call")
        tool: dict[str, Any] = raw_tool if isinstance(raw_tool, dict) else {}
        options = [o for o in data.get("options") or [] if isinstance(o, dict)]
        ids = [str(o.get("optionId") or o.get("option_id")) for o in options]
        self.line(t.magenta(f"[permission {short(request)}] {tool.get('title') or 'the agent asks for permission'}"
                            f" - options: {', '.join(ids) or 'none'}"))
        waiting = request in self.open_requests if self.open_requests is not None else still_open is not False
        if waiting:
            choice = ids[0] if ids else "ID"
            self.line("  answer: " + t.bold(f"kandev permission {short(self.session_id)} {short(request)}"
                                            f" --option {choice}") + " (or --cancel)")

    def _plan(self, data: dict[str, Any]) -> None:
        entries = [e for e in data.get("entries") or [] if isinstance(e, dict)]
        self.line(self.term.dim(f"[plan: {len(entries)} steps]"))
        for e in entries:
            self.line(self.term.dim(f"  - {e.get('content')} ({e.get('status')})"))

    def turn_ended(self, outcome: dict[str, Any]) -> None:
        self.line(turn_end_line(self.term, visible_data(outcome)))
