"""The human form of each ``kandev`` command's result (``--json`` prints the result itself).

Each ``*_lines`` function takes a command's result (and what the command was given) and returns
the lines to print; ``session_show`` writes the conversation itself. Ids are shown 8 characters
long (longer only where two shown ids would otherwise look the same).
"""

from __future__ import annotations

from daemon.cli.human.fmt import (
    age,
    duration_ms,
    network_refusals,
    out_of_space_line,
    quiet_hint,
    quiet_text,
    session_state,
    short,
    state_styles,
    stop_reason_ok,
    unique_length,
    when,
    with_host,
    yes_no,
)
from daemon.cli.human.status import warnings
from daemon.cli.human.table import Cell, cell, render_table
from daemon.cli.human.term import Colour, Term
from daemon.cli.human.transcript import ConversationWriter, turn_end_line
from daemon.cli.human.visible import visible
from daemon.store.states import Attention, SessionState, TurnState

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: every CLI call imports this module
if TYPE_CHECKING:
    from typing import IO, Any

BUCKETS = (("needs_attention", "Needs attention"), ("backlog", "Backlog"), ("running", "Running"),
           ("turn_finished", "Turn finished"), ("done", "Done"))
"""The board's sections, what needs the user first."""
HIDDEN_BY_DEFAULT = frozenset({SessionState.COMPLETED, SessionState.CANCELLED})
"""Session states `session list` leaves out unless --all (finished: nothing more will happen)."""


def _hint(term: Term, text: str) -> str:
    return term.dim(f"hint: {text}")


def _runtime(config: dict[str, Any] | None) -> list[str]:
    config = config or {}
    options = config.get("options") or {}
    return [f"  model:   {config.get('model') or '-'}", f"  mode:    {config.get('mode') or '-'}",
            "  options: " + (", ".join(f"{k}={v}" for k, v in sorted(options.items())) or "-")]


# -- configuration ---------------------------------------------------------------------------

def configuration_line(file: str | None, reason: str | None) -> str:
    """Which configuration file an inspection command read, and why that one."""
    return (f"Configuration: {file or 'no file (every key at its default or from KANDEV_* variables)'}"
            + (f" ({reason})" if reason else ""))


def agents_lines(result: dict[str, Any], term: Term) -> list[str]:
    """``kandev agents``: which file, then a table of the agents and what each gets (never a
    value; the network: its mode and, in the allow-list mode, the hosts it may reach), then any key file that would refuse the agent's start, with its fix."""
    rows = []
    for a in result.get("agents") or []:
        secret = ", ".join(f"{var} <- {ref}" for var, ref in (a.get("secret_env") or {}).items())
        files = ", ".join(f"~/{dest} <- {src}" for dest, src in (a.get("home_files") or {}).items())
        net = a.get("network") or {}
        hosts = ", ".join(net.get("allow_hosts") or []) if net.get("mode") == "allow-list" else ""
        network = f"{net.get('mode', '?')}{f' ({hosts})' if hosts else ''}"
        rows.append([a.get("name"), a.get("package"), a.get("version"), secret, files, ", ".join(a.get("env") or []),
                     network])
    lines = [configuration_line(result.get("config"), result.get("reason")), ""]
    lines += render_table(term, ["AGENT", "PACKAGE", "VERSION", "SECRET_ENV", "HOME_FILES", "ENV", "NETWORK"], rows,
                          flex=6)
    problems = result.get("problems") or []
    if problems:
        lines.append("")
    for p in problems:
        lines.append(term.paint(f"problem: {p.get('key')}: {p.get('what')}", Colour.YELLOW))
        lines.append(_hint(term, f"fix: {p.get('fix')}"))
    return lines


# -- backend lifecycle -----------------------------------------------------------------------

def up_lines(result: dict[str, Any], term: Term) -> list[str]:
    status = result.get("status") or {}
    cap = status.get("capability") or {}
    verb = "started" if result.get("started") else "already running"
    lines = [f"{term.green(term.bullet)} Backend {verb}: pid {result.get('pid')}, "
             f"{(status.get('backend') or {}).get('state', 'ready')}; agent survival {cap.get('state', '-')}"
             + (f" ({cap['reason']})" if cap.get("reason") else "")]
    lines += [term.yellow(f"  warning: {w}") for w in warnings(status)]
    return lines


def down_lines(result: dict[str, Any], term: Term) -> list[str]:
    if not result.get("running", True):
        return [f"No backend is running for {result.get('home')}: nothing to stop."]
    agents = result.get("agents")
    one = agents == 1
    counted = f"{agents} agent{'' if one else 's'}" if agents is not None else "agents"
    tail = (f"its {counted} {'keeps' if one else 'keep'} running and the next backend re-tracks"
            f" {'it' if one else 'them'}" if result.get("detached")
            else f"its {counted} {'was' if one else 'were'} stopped")
    turns = int(result.get("turns") or 0)
    if turns:
        tail += f", ending {turns} running turn{'' if turns == 1 else 's'}"
    lines = [f"Backend stopped (pid {result.get('pid')}); {tail}."]
    survival = result.get("survival")
    if turns and survival == "disabled":
        lines.append(_hint(term, f"survival is off, so {'that turn was' if turns == 1 else 'those turns were'}"
                           " interrupted; to keep agents and their turns running across a restart next time:"
                           " kandev up --survival (or features.agent_survival = true)"))
    elif turns and survival == "unavailable":
        lines.append(_hint(term, "agent survival is unavailable here, so agents stop with the backend;"
                           " kandev doctor says why"))
    return lines


def agentctl_reload_lines(result: dict[str, Any], term: Term) -> list[str]:
    """``kandev agentctl reload``: what ran before and after, and the pause it cost."""
    before, after = result.get("version_before") or "?", result.get("version") or "?"
    pid, pid_before = result.get("pid"), result.get("pid_before")
    same = "same process" if pid == pid_before else f"pid was {pid_before}"
    lines = [f"Control server re-executed in place: version {before} -> {term.bold(str(after))}"
             f" (pid {pid}, {same}; every agent kept running)",
             f"  paused {duration_ms(result.get('pause_ms'))}; re-executions in this server's life:"
             f" {result.get('reexec_count', '-')}"]
    installed = result.get("installed_version")
    if installed and installed != after:
        lines.append(term.yellow(f"  installed version is {installed}: the files changed again meanwhile;"
                                 " reload again to run it"))
    return lines


# -- tasks -----------------------------------------------------------------------------------

def task_create_lines(result: dict[str, Any], term: Term) -> list[str]:
    tid = short(result.get("task_id"))
    lines = [f"Created task {term.bold(tid)}", f"  workspace: {result.get('workspace') or '-'}"]
    workflow = result.get("workflow")
    if isinstance(workflow, dict):
        names = [s.get("name") for s in workflow.get("steps") or []]
        lines.append(f"  workflow:  {' -> '.join(str(n) for n in names)} (in step {names[0] if names else '-'})")
    lines.append(_hint(term, f"start an agent on it: kandev session start {tid} [--prompt TEXT]"))
    return lines


def task_proceed_lines(result: dict[str, Any], term: Term) -> list[str]:
    lines = [f"Task {short(result.get('task_id'))} entered step {result.get('step')!r}"
             f" (step {int(result.get('position') or 0) + 1})"]
    reset = result.get("reset")
    if isinstance(reset, dict):
        lines.append(f"  context reset: new provider session ({reset.get('path')})")
    prompt = result.get("prompt")
    if isinstance(prompt, dict):
        lines.append(f"  prompt sent: turn {short(prompt.get('turn_id'))}")
        if result.get("session_id"):
            lines.append(_hint(term, f"watch it: kandev follow {short(result['session_id'])}"))
    return lines


def _step_status(term: Term, status: str | None) -> str:
    return {"active": term.green, "blocked": term.red, "done": term.dim}.get(status or "", str)(status or "-")


def task_workflow_lines(result: dict[str, Any], term: Term) -> list[str]:
    steps = result.get("steps") or []
    if not steps:
        return [f"Task {short(result.get('task_id'))} has no workflow steps"
                " (kandev task create --steps 'plan,implement:reset:prompt=...')"]
    rows = []
    for s in steps:
        mark = ">" if s.get("name") == result.get("current") else " "
        rows.append([f"{mark}{int(s.get('position') or 0) + 1}", cell(s.get("name"), Colour.BOLD) if mark == ">" else s.get("name"),
                     _step_status(term, s.get("status")), yes_no(s.get("reset")), s.get("prompt") or "-",
                     s.get("detail") or "-"])
    return [f"Task {short(result.get('task_id'))}: step {result.get('current') or '-'}"] + render_table(
        term, ["#", "STEP", "STATUS", "RESET", "PROMPT", "DETAIL"], rows, flex=4)


def _session_brief(session: dict[str, Any] | None) -> tuple[str, str]:
    if not session:
        return "-", "-"
    return str(session.get("agent") or "-"), str(session.get("state") or "-")


def _step_brief(workflow: dict[str, Any] | None) -> str:
    if not workflow or workflow.get("step") is None:
        return "-"
    return f"{workflow['step']} ({int(workflow.get('position') or 0) + 1}/{workflow.get('steps')})"


def task_list_lines(result: dict[str, Any], term: Term) -> list[str]:
    tasks = list(reversed(result.get("tasks") or []))  # newest first
    if not tasks:
        return ["No tasks. Create one: kandev task create --title TITLE"]
    n = unique_length(t["task_id"] for t in tasks)
    rows = []
    for t in tasks:
        agent, state = _session_brief(t.get("latest_session"))
        shown, styles = session_state(state, None, t.get("latest_session")) if t.get("latest_session") else (
            state, state_styles(state))
        rows.append([short(t["task_id"], n), t.get("title") or "-", t.get("bucket") or "-", str(t.get("sessions", 0)),
                     agent, cell(shown, *styles), _step_brief(t.get("workflow")),
                     age(t.get("created_at"))])
    headers = ["TASK", "TITLE", "BUCKET", "SESSIONS", "AGENT", "STATE", "STEP", "AGE"]
    with_host(headers, rows, [(t.get("latest_session") or {}).get("host") for t in tasks], 4)
    return render_table(term, headers, rows, flex=1)


def _shown_state(session: dict[str, Any]) -> tuple[Any, ...]:
    """A session's state and its styles, marked where its cluster host is not ready."""
    state = session.get("state")
    if session.get("host_state") not in (None, "ready"):
        shown, styles = session_state(state, None, session)
        return (shown, *styles)
    return (state, *state_styles(state))


def task_show_lines(result: dict[str, Any], term: Term) -> list[str]:
    label = 11
    lines = [f"{term.bold('Task ' + short(result.get('task_id')))}: {result.get('title')}"]

    def field(name: str, value: Any) -> None:
        lines.append(f"{(name + ':').rjust(label)} {value if value not in (None, '') else '-'}")

    field("Id", result.get("task_id"))
    field("Bucket", result.get("bucket"))
    field("Executor", result.get("executor"))
    field("Workspace", result.get("workspace"))
    field("Created", f"{result.get('created_at')} ({age(result.get('created_at'))} ago)")
    field("Workflow", _step_brief(result.get("workflow")))
    for step in result.get("steps") or []:
        lines.append(" " * (label + 1) + f"{int(step.get('position') or 0) + 1}. {step.get('name')}"
                     f" [{_step_status(term, step.get('status'))}]" + (" reset" if step.get("reset") else "")
                     + (f" prompt={step['prompt']!r}" if step.get("prompt") else ""))
    sessions = result.get("session_list") or []
    field("Sessions", str(len(sessions)))
    if sessions:
        n = unique_length(s["session_id"] for s in sessions)
        rows = [[short(s["session_id"], n), s.get("agent") or "-", cell(*_shown_state(s)),
                 "yes" if s.get("retracked") else ("live" if s.get("live") else "no"), age(s.get("created_at")),
                 s.get("last_error") or "-"] for s in sessions]
        headers = ["SESSION", "AGENT", "STATE", "RETRACKED", "AGE", "LAST ERROR"]
        with_host(headers, rows, [s.get("host") for s in sessions], 1)
        lines += ["  " + line for line in render_table(term, headers, rows, flex=len(headers) - 1)]
        lines.append(_hint(term, f"kandev session show {short(sessions[0]['session_id'], n)}"))
    else:
        lines.append(_hint(term, f"start an agent: kandev session start {short(result.get('task_id'))}"))
    return lines


def board_lines(result: dict[str, Any], term: Term) -> list[str]:
    tasks = result.get("tasks") or []
    n = unique_length(t["task_id"] for t in tasks) if tasks else 8
    full = result.get("store_out_of_space")
    lines: list[str] = [term.red(out_of_space_line(full))] if full else []  # the header: before every bucket
    hints: list[str] = []
    for bucket, title in BUCKETS:
        mine = [t for t in tasks if t.get("bucket") == bucket]
        lines.append(term.bold(f"{title.upper()} ({len(mine)})"))
        if not mine:
            continue
        rows = []
        for t in mine:
            session = t.get("latest_session") or {}
            agent, state = _session_brief(t.get("latest_session"))
            attention = t.get("attention") or {}
            reason = attention.get("reason")
            failed = reason in (Attention.FAILED, Attention.TIMEOUT) or state == SessionState.FAILED
            # e.g. interrupted: the backend stopped and survival is off
            detail = Cell(str((session.get("last_error") if failed else None) or t.get("interrupted") or ""))
            quiet = session.get("quiet")
            if quiet:  # a running turn whose agent has said nothing for agents.quiet_warning_s
                detail = cell(quiet_text(quiet), Colour.YELLOW)
                hints.append(_hint(term, f"{short(t['task_id'], n)}: {quiet_hint(quiet)}"))
            # the state as session list shows it: NO AGENT where the session has none
            shown_state, styles = session_state(state, session.get("live") if "live" in session else None, session)
            row = [short(t["task_id"], n), t.get("title") or "-", agent, cell(shown_state, *styles),
                   short(session.get("session_id"))]
            if bucket == "needs_attention":
                row.insert(0, cell(reason or "-", Colour.YELLOW))
            rows.append([*row, detail])
            if attention.get("hint"):
                hints.append(_hint(term, f"{short(t['task_id'], n)}: {attention['hint']}"))
        header = ["TASK", "TITLE", "AGENT", "STATE", "SESSION", ""]
        if bucket == "needs_attention":
            header.insert(0, "REASON")
        with_host(header, rows, [(t.get("latest_session") or {}).get("host") for t in mine], header.index("AGENT"))
        table = render_table(term, header, rows, flex=2 if bucket == "needs_attention" else 1)
        lines += ["  " + line for line in table[1:]]  # the section title says what the columns are
    return lines + hints


def task_done_lines(result: dict[str, Any], term: Term) -> list[str]:
    return [f"Task {short(result.get('task_id'))} is done: the board shows it under DONE"
            " (kandev task reopen takes it back)."]


def task_reopen_lines(result: dict[str, Any], term: Term) -> list[str]:
    bucket = str(result.get("bucket") or "-").replace("_", " ").upper()
    return [f"Task {short(result.get('task_id'))} is reopened: the board shows it under {bucket}."]


# -- sessions ----------------------------------------------------------------------------------

def session_start_lines(result: dict[str, Any], term: Term, agent: str) -> list[str]:
    sid = short(result.get("session_id"))
    lines = [f"Started session {term.bold(sid)} (agent {agent})"]
    if result.get("turn_id"):
        lines.append(f"  prompt sent: turn {short(result['turn_id'])}")
        lines.append(_hint(term, f"watch it: kandev follow {sid}"))
    else:
        lines.append(_hint(term, f"send a prompt: kandev prompt {sid} TEXT --follow"))
    return lines


def _last_turn(turn: dict[str, Any] | None) -> str:
    if not turn:
        return "-"
    if turn.get("state") == TurnState.OPEN:
        return f"#{turn.get('ordinal')} running {age(turn.get('started_at'))}"
    return f"#{turn.get('ordinal')} {turn.get('stop_reason') or turn.get('state')} {age(turn.get('ended_at'))} ago"


def session_list_lines(result: dict[str, Any], term: Term, show_all: bool) -> list[str]:
    sessions = result.get("sessions") or []
    shown = [s for s in sessions if show_all or s.get("state") not in HIDDEN_BY_DEFAULT]
    hidden = len(sessions) - len(shown)
    if not shown:
        lines = ["No sessions." if not sessions else "No running sessions."]
    else:
        n = unique_length(s["session_id"] for s in shown)
        # RETRACKED only once a session was re-tracked (agent survival): a column of "no" says nothing
        retracked = any(s.get("retracked") for s in shown)
        rows = []
        for s in shown:
            shown_state, styles = session_state(s.get("state"), bool(s.get("live")), s)
            last_turn = _last_turn(s.get("last_turn"))
            if s.get("quiet"):  # its agent has said nothing for agents.quiet_warning_s
                last_turn += f", no output for {s['quiet'].get('seconds')} s"
            rows.append([short(s["session_id"], n), short(s.get("task_id")), s.get("task_title") or "-",
                         s.get("agent") or "-", cell(shown_state, *styles),
                         *([yes_no(s.get("retracked"))] if retracked else []),
                         age(s.get("created_at")), last_turn])
        headers = ["SESSION", "TASK", "TITLE", "AGENT", "STATE", *(["RETRACKED"] if retracked else []), "AGE",
                   "LAST TURN"]
        with_host(headers, rows, [s.get("host") for s in shown], 3)
        # The ids and the state stay whole: the last turn gives way first, then the title.
        lines = render_table(term, headers, rows, flex=(len(headers) - 1, 2))
    if hidden:
        lines.append(term.dim(f"({hidden} finished session{'s' if hidden != 1 else ''} not shown; --all shows them)"))
    return lines


def session_header_lines(show: dict[str, Any], term: Term, task_title: str | None) -> list[str]:
    label = 12
    state = str(show.get("state") or "-")
    sid = str(show.get("session_id") or "")
    title = f" {task_title!r}" if task_title else ""
    lines = [f"{term.paint(term.bullet, *state_styles(state))} {term.bold('Session ' + short(sid))}"
             f" of task {short(show.get('task_id'))}{title}"]

    def field(name: str, value: Any) -> None:
        lines.append(f"{(name + ':').rjust(label)} {value if value not in (None, '') else '-'}")

    liveness = "live" if show.get("live") else "no running agent"
    if show.get("host_state") not in (None, "ready"):  # another host's session: its last known state
        liveness = f"host {show.get('host')} {show.get('host_state')}: its last known state, not known to be live"
    elif show.get("host"):
        liveness += f", on host {show['host']}"
    if show.get("retracked"):
        liveness += ", re-tracked after a backend restart"
    field("State", f"{term.paint(state, *state_styles(state))} ({liveness})")
    pid = show.get("agent_pid")
    pid_text = (f", pid {pid}" if show.get("live") else f" (last pid {pid})") if pid else ""
    field("Agent", f"{show.get('agent')}" + pid_text
          + (", passthrough" if show.get("passthrough") else ""))
    runtime = show.get("runtime_config") or {}
    options = runtime.get("options") or {}
    field("Model/mode", f"{runtime.get('model') or '-'} / {runtime.get('mode') or '-'}"
          + (f"; {', '.join(f'{k}={v}' for k, v in sorted(options.items()))}" if options else ""))
    prep = show.get("runtime_prepare") or {}
    if prep and (state == SessionState.STARTING or prep.get("state") != "succeeded"):
        field("Runtime", f"{'preparing ' if state == SessionState.STARTING else ''}{prep.get('spec')}"
              f" (job {short(prep.get('job_id'))}): [{prep.get('state')}] {prep.get('message') or ''}".rstrip())
    net = network_refusals(show.get("network"))
    if net is not None:
        field("Network", term.yellow(net) if (show.get("network") or {}).get("refused") else net)
    if show.get("guard"):
        field("Guard", term.yellow(str(show["guard"])))
    if show.get("not_retracked_reason"):
        field("Not re-tracked", show["not_retracked_reason"])
    if show.get("last_error"):
        field("Last error", term.red(str(show["last_error"])))
    quiet = show.get("quiet")
    if quiet:  # its running turn's agent has said nothing for agents.quiet_warning_s
        field("Waiting", term.yellow(quiet_text(quiet)))
        lines.append(_hint(term, quiet_hint(quiet)))
    field("Turns", str(show.get("turns_total", len(show.get("turns") or []))))
    field("Id", sid)
    if show.get("recoverable") and not show.get("live"):
        lines.append(_hint(term, f"give it an agent again: kandev resume {short(sid)}"))
    return lines


def session_show(show: dict[str, Any], term: Term, out: IO[str], task_title: str | None) -> None:
    """Header, then the transcript page as a conversation (turn by turn)."""
    for line in session_header_lines(show, term, task_title):
        out.write(line + "\n")
    turns = show.get("turns") or []
    first_ordinal = int(show.get("turns_total") or len(turns)) - len(turns) + 1
    by_id = {t["turn_id"]: (first_ordinal + i, t) for i, t in enumerate(turns)}
    page = show.get("page") or {}
    entries = show.get("transcript") or []
    open_requests = {p["request_id"] for p in show.get("permissions") or [] if p.get("state") == "open"}
    sid = str(show.get("session_id") or "")
    writer = ConversationWriter(out, term, sid, open_requests=open_requests)
    out.write("\n")
    if page.get("more_before"):
        out.write(term.dim(f"({int(page.get('total') or 0) - int(page.get('count') or 0)} earlier entries not"
                           f" shown: --tail N shows more, --after-seq 0 pages from the start)") + "\n")
    if not entries:
        out.write(term.dim("(no transcript yet)") + "\n")
        return
    current: str | None = None

    def close(turn_id: str | None) -> None:
        if turn_id is None or turn_id not in by_id:
            return
        ordinal, turn = by_id[turn_id]
        if turn.get("state") != TurnState.OPEN:
            writer.turn_ended({**turn, "ordinal": ordinal})

    for e in entries:
        turn_id = e.get("turn_id")
        if turn_id and turn_id != current and (e.get("kind") == "prompt" or current is None):
            close(current)
            writer.end_run()
            ordinal = by_id.get(turn_id, (None, {}))[0]
            continued = "" if e.get("kind") == "prompt" else " (continued)"
            out.write(("\n" if current is not None else "")
                      + term.dim(f"-- turn {ordinal if ordinal else '?'}{continued} --") + "\n")
            current = turn_id
        writer.entry(e)
    writer.end_run()
    if not page.get("more_after"):
        close(current)
    else:
        out.write(term.dim(f"(more entries: --after-seq {page.get('next_cursor')})") + "\n")


def session_configure_lines(result: dict[str, Any], term: Term) -> list[str]:
    return [f"Session {short(result.get('session_id'))} configured:"] + _runtime(result.get("runtime_config"))


def session_reset_lines(result: dict[str, Any], term: Term) -> list[str]:
    return ([f"Session {short(result.get('session_id'))} has a new provider session"
             f" ({result.get('path')}); state {result.get('state')}:"] + _runtime(result.get("runtime_config")))


def resume_lines(result: dict[str, Any], term: Term) -> list[str]:
    how = "a fresh conversation" if result.get("fresh") else (
        "its conversation loaded" if result.get("loaded") else "a new conversation")
    sid = short(result.get("session_id"))
    return ([f"Session {term.bold(sid)} resumed with {how}; state {result.get('state')}:"]
            + _runtime(result.get("runtime_config"))
            + [_hint(term, f"send a prompt: kandev prompt {sid} TEXT --follow")])


def prompt_lines(result: dict[str, Any], term: Term, session: str) -> list[str]:
    if "stop_reason" in result:
        reason = result.get("stop_reason")
        state = "finished" if reason not in (None, "agent_exited") else "abandoned"
        return [f"Turn {short(result.get('turn_id'))}: " + turn_end_line(term, {"state": state, "stop_reason": reason})]
    return [f"Prompt sent: turn {short(result.get('turn_id'))}", _hint(term, f"watch it: kandev follow {session}")]


def cancel_lines(session: str) -> list[str]:
    return [f"Cancel sent to session {session}: its running turn ends with stop reason cancelled."]


def session_stop_lines(result: dict[str, Any], term: Term) -> list[str]:
    sid = short(result.get("session_id"))
    pid = result.get("agent_pid")
    turn = result.get("stopped_turn_id")
    return [f"Stopped the agent of session {sid}" + (f" (pid {pid}, its whole process group)" if pid else "")
            + (f" and its running turn {turn}" if turn else "") + f"; the session stays readable (kandev session show {sid}) and kandev resume {sid} gives it an"
            " agent again."]


def log_text(text: str, term: Term) -> str:
    """An agent's stderr for a person: its own bytes, but never a control sequence (the agent wrote
    them, and a terminal would obey them): those are shown escaped."""
    return visible(text)


def logs_lines(result: dict[str, Any], term: Term) -> list[str]:
    text = result.get("text") or ""
    if not text:
        where = "running" if result.get("live") else "last"
        return [term.dim(f"(the {where} agent of session {short(result.get('session_id'))} wrote nothing to"
                         f" its standard error: {result.get('path')})")]
    return log_text(text, term).rstrip("\n").split("\n")


def permission_lines(session: str, request: str, option: str | None) -> list[str]:
    answer = f"answered {option}" if option else "cancelled"
    return [f"Permission request {short(request)} of session {session}: {answer}."]


def runtime_lines(result: dict[str, Any], term: Term) -> list[str]:
    probe = result.get("probe") or {}
    ok = result.get("state") == "succeeded"
    paint = term.green if ok else term.red
    lines = [f"Runtime {result.get('agent')} ({result.get('package')}@{result.get('version')}): "
             + paint(str(result.get("state"))) + f" after {result.get('attempts')} attempt(s)"
             + (", cache repaired" if result.get("repaired") else "")]
    lines.append(f"  ACP probe: {'ok' if probe.get('ok') else 'failed'}"
                 + (f", protocol {probe['protocol_version']}" if probe.get("protocol_version") is not None else "")
                 + (f", {probe['agent_name']} {probe.get('agent_version') or ''}".rstrip()
                    if probe.get("agent_name") else ""))
    if result.get("detail"):
        lines.append(f"  {result['detail']}")
    return lines


def turn_ok(outcome: dict[str, Any]) -> bool:
    return stop_reason_ok(outcome.get("state"), outcome.get("stop_reason"), outcome.get("error"))


def task_delete_lines(result: dict[str, Any], term: Term) -> list[str]:
    n = len(result.get("sessions") or [])
    lines = [f"Task {term.bold(short(result.get('task_id')))} deleted with {n} session{'' if n == 1 else 's'}"
             f" (their directories and agents' HOMEs removed)."]
    if result.get("stopped"):
        lines.append(f"Stopped the agent{'' if len(result['stopped']) == 1 else 's'} of"
                     f" {', '.join(short(s) for s in result['stopped'])} first.")
    lines.append(f"Workspace {result.get('workspace') or '-'}: {result.get('worktree')}.")
    return lines


def hosts_lines(result: dict[str, Any], term: Term) -> list[str]:
    """``kandev hosts`` (Issue 47): one row per host of the cluster, this one marked ``*``."""
    hosts = result.get("hosts") or []
    if result.get("host") is None:
        return ["This backend is a single host: no cluster.host is set (docs/cluster.md)."]
    rows = []
    for h in hosts:
        state = str(h.get("state") or "-")
        if state == "unreachable":
            state = f"unreachable since {when(h.get('since'))}"
        colour = Colour.GREEN if h.get("state") == "ready" else Colour.YELLOW
        rows.append([f"{h.get('name')}{' *' if h.get('own') else ''}", cell(state, colour), h.get("version") or "-",
                     str(h.get("sessions", 0)), str(h.get("agents", 0)),
                     f"{when(h.get('last_heartbeat'))} ({age(h.get('last_heartbeat'))} ago)"])
    return render_table(term, ["HOST", "STATE", "VERSION", "SESSIONS", "AGENTS", "LAST HEARTBEAT"], rows, flex=1)
