"""The backend's CLI protocol: one operation table for ``kandev`` and the backend.

The CLI (``daemon.cli``) and the backend's socket server both import
``TABLE``. Peers are admitted by ``SO_PEERCRED`` only (same uid, root or the
service group); there is no further authentication on this socket.
"""

from __future__ import annotations

from enum import Enum, StrEnum

from daemon.api.version import PROTOCOL, VERSION
from ipc.schema import Op, OpTable

OPS = [
    Op("status", auth=False, doc="backend, capability, control_server, recovery, adoption"),
    Op("hosts", auth=False,
       doc="the cluster's hosts (Issue 47) -> {host: this backend's (None: a single host), hosts: [{name, state:"
       " ready|unreachable|stopped, since, last_heartbeat, version, pid, machine, sessions, agents, own}]}"),
    Op("config_show", auth=False,
       doc="the configuration this backend runs with (daemon/config/view.py) -> {file, settings (a secret"
       " one: <hidden>), origins, agents {NAME: {env, secret_env, home_files}}, problems [{key, what, fix}]:"
       " the key files checked now, as this backend's user}, plus pid"),
    Op("shutdown", optional={"agents": bool}, auth=False,
       doc="graceful stop (kandev down); with survival on, agents keep running unless agents (kandev down"
       " --agents): then the control server stops every agent and exits -> {ok, detach, agents: how many"
       " agents this backend tracked}"),
    Op(
        "agentctl_reload",
        auth=False,
        doc="the control server re-executes the installed code in place, every agent keeps running ->"
        " {attempt, outcome: reexecuted, pid, pid_before, version_before, version, installed_version,"
        " reexec_count, pause_ms}; refused: reload_refused (the old code keeps serving) or"
        " reload_unsupported (a server of release 0.1.0: replaced once it runs no instance)",
    ),
    Op(
        "task_create",
        required={"title": str},
        optional={"workspace": str, "executor": str},
        auth=False,
        doc="-> {task_id}",
    ),
    Op(
        "session_start",
        required={"task_id": str},
        optional={"agent": str, "prompt": str, "passthrough": bool, "host": str},
        auth=False,
        doc="-> {session_id, turn_id|None}; host (cluster mode): the host whose backend starts and drives it"
        " (default: this one; another host's answer comes through the store: daemon/backend/cluster/router.py)",
    ),
    Op(
        "prompt",
        required={"session_id": str, "text": str},
        optional={"wait": bool},
        auth=False,
        doc="-> {turn_id, stop_reason (with wait)}",
    ),
    Op("cancel", required={"session_id": str}, auth=False,
       doc="cancel the session's running turn -> {ok}; no running turn: conflict"),
    Op(
        "permission_respond",
        required={"session_id": str, "request_id": str},
        optional={"option_id": str},
        auth=False,
        doc="answer an open permission request of the session's agent; no option_id = cancelled -> {ok}",
    ),
    Op(
        "session_show",
        required={"session_id": str},
        optional={"tail": int, "after_seq": int, "limit": int},
        auth=False,
        doc="state, agent, turns and one transcript page: the last `tail` entries (default 10000), or"
        " `limit` entries after the cursor `after_seq`; `page` carries next_cursor, more_before/after"
        " (daemon/backend/views/session_view.py)",
    ),
    Op(
        "session_list",
        optional={"detail": bool},
        auth=False,
        doc="-> {sessions: [{session_id, task_id, state, retracked}]} in creation order; with detail (for"
        " kandev session list's table) newest first, each also with agent, task_title, live, created_at,"
        " passthrough, last_error and last_turn{ordinal, state, stop_reason, started_at, ended_at}"
        " (daemon/backend/views/lists.py)",
    ),
    Op("board", auth=False, doc="-> {backlog, running, turn_finished, needs_attention, done: [task ids]}; why a"
       " task needs attention: task_list's attention{reason: permission|failed|cancelled|timeout|no agent, hint|None}"),
    Op(
        "store_vacuum",
        auth=False,
        doc="give the store's free pages (e.g. after transcript retention or task deletes) back to the"
        " filesystem -> {bytes_before, bytes_after, seconds}",
    ),
    Op(
        "control_server_retry",
        auth=False,
        doc="where the backend gave up restarting a control server that kept dying, try again now (kandev up)"
        " -> {retried: [link names], state, passthrough_state}",
    ),
]

# Managed npm runtimes (docs/requirements.md#managed-npm-runtimes-context-rules; daemon/backend/handlers/runtimes.py).
RUNTIME_OPS: list[Op] = [
    Op(
        "runtime_update",
        required={"agent": str},
        auth=False,
        doc="start the update job of a built-in managed npm agent, or join its active one -> job "
        "{job_id, agent, package, version, state, attempts, repaired, probe{ok, protocol_version}, detail, "
        "events, joined}",
    ),
    Op(
        "runtime_job",
        required={"job_id": str},
        optional={"after": int, "wait": float},
        auth=False,
        doc="one runtime update job; with wait (s, <= 30), once it has more than `after` events or ended -> job",
    ),
    Op(
        "runtime_ensure",
        required={"agent": str},
        auth=False,
        doc="a built-in agent's runtime before a session starts: {agent, prepared: true, job: None}, or"
        " {agent, prepared: false, reason, job} with the runtime job started or joined (follow: runtime_job)",
    ),
]

# Git credential leases (docs/requirements.md#git-credential-leases-context-rules; daemon/backend/handlers/credentials.py). Called by the agent's
# git transport; the lease token and the capability are secrets (never logged). No op hands out the upstream token (Issue 20).
CREDENTIAL_OPS: list[Op] = [
    Op(
        "credential_redeem",
        required={"lease_token": str, "host": str, "path": str},
        optional={"protocol": str},
        auth=False,
        doc="a check of a lease -> {lease_id, host, repository, expires_at} (no credential); refused for terminal"
        " sessions, expired/revoked/unknown leases, out-of-scope host or path",
    ),
    Op(
        "credential_reissue",
        required={"capability": str},
        auth=False,
        doc="-> {lease_token, lease_id}: a new lease for the capability's scope, re-checked against live state",
    ),
]

# Resume, runtime configuration, context reset and workflow steps (docs/requirements.md#resume-and-runtime-recovery,
# docs/requirements.md#runtime-configuration-across-a-context-reset;
# daemon/backend/handlers/resume.py).
RESUME_OPS: list[Op] = [
    Op(
        "session_resume",
        required={"session_id": str},
        optional={"fresh": bool},
        auth=False,
        doc="give a FAILED, CANCELLED or WAITING_FOR_INPUT session without a live agent an agent again:"
        " ACP session/load of its stored provider session, or with fresh a new one (the token is wiped)"
        " -> {session_id, state, acp_session_id, resume_token, loaded, fresh, runtime_config}",
    ),
    Op(
        "session_configure",
        required={"session_id": str},
        optional={"model": str, "mode": str, "options": dict},
        auth=False,
        doc="apply model (config option of category model), mode, then options by id through the agent"
        " -> {session_id, runtime_config, calls}; a refused field: agent_error, what was accepted is kept",
    ),
    Op(
        "session_reset_context",
        required={"session_id": str},
        optional={"restart": bool},
        auth=False,
        doc="a new provider session (ACP session/new on the same process; restart: a new process) with the"
        " captured model, mode and options restored -> {session_id, state, path, acp_session_id,"
        " runtime_config, captured, calls}; a refused field fails the reset (session FAILED)",
    ),
    Op(
        "workflow_set",
        required={"task_id": str, "steps": str},
        auth=False,
        doc="give a task its workflow steps 'name[:reset][:prompt=TEXT],...'; the first is entered"
        " -> {task_id, steps}",
    ),
    Op("task_workflow", required={"task_id": str}, auth=False, doc="-> {task_id, current, steps: [...]}"),
    Op(
        "task_proceed",
        required={"task_id": str},
        auth=False,
        doc="enter the next step (persisted), then its context reset, then its automatic prompt; a failed"
        " reset blocks the prompt -> {task_id, step, position, session_id, reset, prompt}",
    ),
]

# The named values ``status`` carries (the CLI compares these, not the strings).


class BackendState(StrEnum):
    """The backend's lifetime, as ``kandev status`` shows it."""

    STARTING = "starting"
    RECOVERING = "recovering"  # startup recovery runs: launches wait
    READY = "ready"
    STOPPING = "stopping"
    OUT_OF_SPACE = "out_of_space"  # the store cannot open for lack of space (daemon.backend.lifetime.space_wait)
    STORE_UNREACHABLE = "store_unreachable"  # its database server does not answer yet (lifetime.reach_wait)


class LinkState(str, Enum):
    NONE = "none"  # no server yet (before startup recovery; the passthrough server until first needed)
    RUNNING = "running"
    LOST = "lost"
    RESTARTING = "restarting"
    GAVE_UP = "gave_up"
    SUPERSEDED = "superseded"
    REPLACING = "replacing"  # the backend retires this server for a newer one (not a loss)


class LinkObserved(StrEnum):
    """What ``status`` reports instead of ``LinkState.RUNNING`` when the running server does not
    answer: observations of one status call, not states of the link's state machine."""

    RELOADING = "reloading"  # it re-executes in place (kandev agentctl reload, SIGHUP)
    UNREACHABLE = "unreachable"  # its process is there and it does not answer


class AdoptionOutcome(StrEnum):
    ADOPTED = "adopted"
    NO_SERVER = "no_server"  # nothing recorded, nothing answered, or it is shutting down: no refusal
    REFUSED = "refused"  # with one reason
    DISABLED = "disabled"  # no attempt: the capability is off


class FollowEvent(str, Enum):
    """The kinds of event frames a ``follow`` stream sends (daemon/backend/views/follow.py)."""

    ENTRY = "entry"  # seq = the entry's cursor; data = the transcript entry
    TURN_ENDED = "turn_ended"  # data = {turn_id, ordinal, state, stop_reason, error, ended_at}
    # The followed turn's agent has been silent for agents.quiet_warning_s (again at each multiple):
    # seq = the last cursor sent; data = the quiet object (daemon/backend/views/quiet_report.py)
    QUIET = "quiet"
    END = "end"  # data = {reason: FollowEnd}; the backend then closes the stream


class FollowEnd(str, Enum):
    """Why a ``follow`` stream ended."""

    TURN_ENDED = "turn_ended"
    NO_AGENT = "no_agent"  # no turn to follow and no running agent


# Views for people and the follow stream (Issue 14; daemon/backend/views/lists.py, daemon/backend/views/follow.py).
# Every op that takes a task_id, session_id (or permission request_id) also accepts a unique prefix
# of at least 4 characters (daemon/backend/views/ids.py).
VIEW_OPS: list[Op] = [
    Op(
        "task_list",
        auth=False,
        doc="-> {tasks: [{task_id, title, workspace, executor, state, bucket, attention{reason, hint}|None, created_at, sessions,"
        " latest_session{session_id, agent, state, last_error, live, retracked, quiet{turn_id, seconds,"
        " timed_out, logs, cancel, provider}|None (its running turn's agent silent for"
        " agents.quiet_warning_s: daemon/backend/views/quiet_report.py), ...}|None,"
        " workflow{step, position, status, steps}|None}], store_out_of_space} in creation order;"
        " store_out_of_space: status's store.out_of_space (None unless the store or the home is out of space)",
    ),
    Op(
        "task_show",
        required={"task_id": str},
        auth=False,
        doc="one task as in task_list, plus session_list (newest first) and steps (its workflow)",
    ),
    Op(
        "follow",
        required={"session_id": str},
        optional={"after_seq": int, "turn_id": str, "all": bool},
        auth=False,
        stream=True,
        doc="stream a session's transcript from cursor after_seq (default: the start of the followed turn):"
        " entry events (seq = cursor), turn_ended, end; ends after the followed turn (turn_id, default the"
        " latest) unless all (daemon/backend/views/follow.py)",
    ),
]

# Removing a task (Issue 12; daemon/backend/tasks/delete.py).
TASK_OPS: list[Op] = [
    Op(
        "task_delete",
        required={"task_id": str},
        optional={"stop": bool},
        auth=False,
        doc="remove a task whose sessions have no agent (with stop: idle agents are stopped first): each"
        " session's directory (the agent's HOME, lease, endpoint), the workspace only if kandev created it,"
        " then the rows -> {task_id, deleted, sessions, stopped, workspace, worktree, removed}; a session"
        " with an agent (without stop) or a running turn: conflict",
    ),
]

# Finishing things (Issue 23; daemon/backend/sessions/lifecycle.py).
LIFECYCLE_OPS: list[Op] = [
    Op(
        "session_stop",
        required={"session_id": str},
        auth=False,
        doc="stop the session's idle agent (SIGTERM, then its process group); the session stays readable and"
        " resumable -> {session_id, task_id, instance_id, agent_pid, state}; no agent or a running turn: conflict",
    ),
    Op("task_done", required={"task_id": str}, auth=False,
       doc="the task is done (board: done) -> {task_id, state, bucket}; a turn running: conflict"),
    Op("task_reopen", required={"task_id": str}, auth=False,
       doc="a done task back where its latest session puts it -> {task_id, state, bucket}; not done: conflict"),
    Op(
        "session_logs",
        required={"session_id": str},
        optional={"tail": int, "offset": int, "wait_s": int},
        auth=False,
        doc="the standard error of the session's current (or last) agent: its last `tail` lines (default 50),"
        " or what follows byte `offset` (with `wait_s`, 0..30: once the file changes, or after that many seconds)"
        " -> {session_id, instance_id, path, text, offset (where the next read"
        " starts), size, live}",
    ),
]

OPS = OPS + RUNTIME_OPS + CREDENTIAL_OPS + RESUME_OPS + VIEW_OPS + TASK_OPS + LIFECYCLE_OPS

TABLE = OpTable(PROTOCOL, VERSION, OPS)
