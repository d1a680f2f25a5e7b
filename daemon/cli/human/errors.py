"""A typed error as people read it: ``kandev: <what went wrong>`` and, where one helps, a hint.

``--json`` callers keep the old form (``kandev: <code>: <message>`` on stderr and the error in
the JSON on stdout); this is only the human form.
"""

from __future__ import annotations

from daemon.cli.human.visible import visible
from ipc.errors import ErrorCode, IpcError

_IDS = "ids may be shortened to any unique prefix of 4 or more characters"

_HINTS: dict[str, str] = {
    ErrorCode.UNAVAILABLE: "is the backend running? start it with `kandev up` (or `systemctl start kandev-backend`);"
    " `kandev doctor` checks the installation",
    ErrorCode.AMBIGUOUS_ID: "give more characters of the id",
    ErrorCode.SESSION_GUARDED: "the backend is still recovering this session; try again in a moment",
    ErrorCode.SHUTTING_DOWN: "the backend is stopping; `kandev up` starts it again",
    ErrorCode.INCOMPATIBLE_VERSION: "this kandev and the running backend differ in version; restart the backend",
    ErrorCode.PERMISSION_DENIED: "only root and members of the kandev group may use the backend"
    " (`adduser $USER kandev`, then log in again)",
    ErrorCode.TIMEOUT: "the backend did not answer in time; `kandev status` shows what it is doing",
    ErrorCode.BUFFERS_FULL: "the backend is busy; try again in a moment",
    ErrorCode.RELOADING: "the control server is re-executing in place; try again in a moment",
    "reload_refused": "the running code keeps serving; the reason is in the journal"
    " (`journalctl -u kandev-agentctl KANDEV_EVENT=reload_refused`) or <home>/logs/agentctl.log",
    "reload_unsupported": "the backend replaces it with the installed version once it runs no instance;"
    " end or stop its sessions to have that happen sooner",
    "backend_exited": "`kandev doctor` checks the installation; the backend's log is <home>/logs/backend.log",
    "config_refused": "fix that key in that file; `kandev doctor --config FILE` checks a file without starting"
    " anything",
    "config_mismatch": "`kandev down`, then `kandev up --config FILE` starts it with that file",
    "host_unreachable": "only that host's backend drives its sessions: `kandev hosts` shows when it was last"
    " heard from; try again once it is back",
    "request_interrupted": "`kandev session show` tells whether it took effect; ask again if it did not",
}


def hint_for(error: IpcError, command: str | None = None, session_id: str | None = None) -> str | None:
    """The hint line for ``error`` in the context of ``command`` (None: no useful hint)."""
    code, message = error.code, error.message
    if code == ErrorCode.NOT_FOUND:
        if "session" in message:
            return f"`kandev session list --all` lists the sessions; {_IDS}"
        if "task" in message:
            return f"`kandev task list` lists the tasks; {_IDS}"
        return None
    if code == ErrorCode.CONFLICT and "no agent to stop" in message and session_id:
        return f"`kandev resume {session_id}` gives the session an agent again"
    if code == ErrorCode.CONFLICT and "no running agent" in message and session_id:
        return f"`kandev resume {session_id}` gives the session an agent again"
    if code == ErrorCode.CONFLICT and "turn is in progress" in message and session_id:
        return f"wait for it (`kandev follow {session_id}`) or cancel it (`kandev cancel {session_id}`)"
    key = str((error.details or {}).get("key") or "")
    if code == "config_refused" and key.startswith("agents.") and (".secret_env." in key or ".home_files." in key):
        return ("the file the setting names is what needs fixing (the fix is above); `kandev doctor --config FILE`"
                " lists every such file")
    if code == ErrorCode.AGENT_ERROR and session_id:
        return f"`kandev session show {session_id}` shows the agent's last error"
    return _HINTS.get(code)


def error_lines(error: IpcError, command: str | None = None, session_id: str | None = None) -> list[str]:
    """What stderr gets for ``error`` (without --json)."""
    lines = [f"kandev: {visible(error.message or error.code)}"]  # may quote an agent (its stderr tail)
    details = error.details or {}
    if error.code == ErrorCode.AMBIGUOUS_ID and isinstance(details.get("candidates"), list):
        noun = details.get("kind") or "object"
        lines = [f"kandev: {noun} id {details.get('given')!r} is ambiguous; it is the start of"
                 f" {details.get('total')} {noun}s:"]
        lines += [f"  {c}" for c in details["candidates"]]
        more = int(details.get("total") or 0) - len(details["candidates"])
        if more > 0:
            lines.append(f"  ... and {more} more")
    hint = hint_for(error, command, session_id)
    if hint:
        lines.append(f"hint: {hint}")
    return lines
