"""The backend's CLI protocol: one operation table for ``kandev`` and the backend.

The CLI (``daemon.cli``) and the backend's socket server both import
``TABLE``. Peers are admitted by ``SO_PEERCRED`` only (same uid, root or the
service group); there is no further authentication on this socket.
"""

from __future__ import annotations

from ipc.schema import Op, OpTable

PROTOCOL = "kandev-backend"
VERSION = (1, 1)  # 1.1 (release 0.2.0): agentctl_reload; fields are only ever added

OPS = [
    Op("status", auth=False, doc="backend, capability, control_server, recovery, adoption"),
    Op("shutdown", auth=False, doc="graceful stop (kandev down); with survival on, agents keep running"),
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
        optional={"agent": str, "prompt": str, "passthrough": bool},
        auth=False,
        doc="-> {session_id, turn_id|None}",
    ),
    Op(
        "prompt",
        required={"session_id": str, "text": str},
        optional={"wait": bool},
        auth=False,
        doc="-> {turn_id, stop_reason (with wait)}",
    ),
    Op("cancel", required={"session_id": str}, auth=False, doc="-> {ok}"),
    Op(
        "permission_respond",
        required={"session_id": str, "request_id": str},
        optional={"option_id": str},
        auth=False,
        doc="answer an open permission request of the session's agent; no option_id = cancelled -> {ok}",
    ),
    Op("session_show", required={"session_id": str}, auth=False, doc="see design.md §8"),
    Op("session_list", auth=False, doc="-> {sessions: [...]}"),
    Op("board", auth=False, doc="-> {backlog, running, turn_finished, needs_attention, done}"),
]

# Managed npm runtimes (seed 000; daemon/backend/runtimes_api.py).
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
]

# Git credential leases (seed 000; daemon/backend/credentials_api.py). Called by the shipped git
# credential helper; the lease token, the capability and the password are secrets (never logged).
CREDENTIAL_OPS: list[Op] = [
    Op(
        "credential_redeem",
        required={"lease_token": str, "host": str, "path": str},
        optional={"protocol": str},
        auth=False,
        doc="-> {username, password, lease_id, host, repository, expires_at}; refused for terminal"
        " sessions, expired/revoked/unknown leases, out-of-scope host or path",
    ),
    Op(
        "credential_reissue",
        required={"capability": str},
        auth=False,
        doc="-> {lease_token, lease_id}: a new lease for the capability's scope, re-checked against live state",
    ),
]

# Resume, runtime configuration, context reset and workflow steps (seeds 000/004;
# daemon/backend/resume_api.py).
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

OPS = OPS + RUNTIME_OPS + CREDENTIAL_OPS + RESUME_OPS

TABLE = OpTable(PROTOCOL, VERSION, OPS)
