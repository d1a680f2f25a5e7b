"""The control-server protocol: one operation table shared by server and client.

The backend (client) and ``kandev-agentctl`` (server) both import ``TABLE``;
nothing else defines what a request looks like. Evolution rule: fields and
ops are only ever added (backend N must talk to control server N-1), and the
minor version rises with each addition: 1.0 is what release 0.1.0 speaks; 1.1
(release 0.2.0) added ``reload`` and ``server_info``, the ``reload.v1``
capability, the ``not_taken_over`` field of ``list_instances`` and the
``reloading`` error code; and the agent sandbox: ``create_instance``'s
``sandbox`` field and ``sandboxed`` answer, ``sandbox_status``, the
``sandbox.v1`` capability and the ``sandbox_unavailable`` error code; and each agent's keys:
``create_instance``'s ``secret_env`` field and the ``agent_secrets.v1`` capability. 1.2
(release 0.3.0) added ``turn_statuses`` (the turn status of many instances in one exchange, for
recovery in bulk; a backend meeting 1.1 reads them one by one) and ``attach``'s ``batched``
field (the events of one write in one frame; a 1.1 server ignores it and sends a frame per
event, which the client reads as well), and ``attach_many`` and ``detach`` (the event streams of
many instances on one connection; capability ``attach_many.v1``: a backend meeting a server
without it attaches each instance on a connection of its own), ``create_instance``'s
``max_memory`` (each agent's memory bound; capability ``agent_memory.v1``). 1.3 (Issue 44) added each
agent's network: ``create_instance``'s ``network`` field, the ``network`` of ``list_instances`` and
``sandbox_status``, ``sandbox_status``' ``network_namespace``, and the ``network.v1`` capability.
``identify`` never grows: unauthenticated, it answers
the identity, the capability set and the unowned period (and the protocol
version), nothing else (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11).

Adoption needs ``REQUIRED_CAPABILITIES`` only, never a capability added later:
a backend adopts a server one release older and learns from ``identify`` what
else it can do (``reload.v1``: it can re-execute newer code in place;
``sandbox.v1``: it runs agents in their sandbox). A server without ``sandbox.v1``
ignores ``create_instance``'s ``sandbox`` field (unknown fields are dropped) and
would start the agent unsandboxed: the client refuses such a launch itself when
the policy requires the sandbox (``AgentctlClient.create_instance``).

Authentication (docs/architecture.md#ownership): ``identify``, ``prove``, ``auth_begin`` and
``auth_finish`` work on an unauthenticated connection; everything else needs
a connection that finished ``auth_finish``. The credential never crosses the
socket: the server proves possession with an HMAC over the backend's fresh
challenge, and the backend authenticates each connection with an HMAC over a
server nonce (see ``daemon.agentctl.auth``).

Streams: ``attach`` turns its connection into an event stream of
``{seq, kind, data}`` frames (or, asked with ``batched``, ``{events: [[seq, kind, data], ...]}``
frames) for one instance, starting after ``after_seq``; ``attach_many`` turns it into the
streams of many (``{instance, events: [...]}`` frames, and ``{instance, end: true}`` when one ends).
"""

from __future__ import annotations

from ipc.schema import Op, OpTable

PROTOCOL = "kandev-agentctl"
VERSION = (1, 3)

# What adoption requires (set inclusion, never version ordering): what release 0.1.0 already had.
REQUIRED_CAPABILITIES = (
    "instances.v1",  # create/list/stop instances with server-held session identity
    "events.v1",  # attach stream with per-instance seq, after_seq replay, ack_events
    "turns.v1",  # server-assigned turn ids, turn_status + ack_turn
    "ownership.v1",  # prove/auth/claim/ownership_shutdown
    "rotation.v1",  # rotate/confirm_rotation, at most two acceptable credentials, superseded_credential
)
RELOAD_CAPABILITY = "reload.v1"
"""The ``reload`` op: re-execute the installed code in place with the state handed over (Issue 15)."""

SANDBOX_CAPABILITY = "sandbox.v1"
"""Agents run in their sandbox (``create_instance``'s ``sandbox`` field, ``sandbox_status``; Issue 10)."""

AGENT_SECRETS_CAPABILITY = "agent_secrets.v1"
"""``create_instance``'s ``secret_env`` field: the server reads each agent's keys at spawn into that
agent's environment (Issue 12). A server without it would drop the field and start the agent
without its keys, so the client refuses such a launch (``AgentctlClient.check_secret_env``)."""

# Capability set advertised by identify/hello: the required ones and what was added since.
AGENT_LIMITS_CAPABILITY = "agent_limits.v1"
"""``create_instance``'s ``sandbox`` takes ``max_processes`` (the agent's RLIMIT_NPROC), agents run off
uid 0 with their own IPC namespace, stderr through the server, and ``agent_exited`` names a ``signal``
kandev did not send (0.3.0). A server without it is sent no ``max_processes``."""
ATTACH_MANY_CAPABILITY = "attach_many.v1"
"""The ``attach_many`` and ``detach`` ops: the event streams of many instances on one connection (0.3.0)."""
AGENT_MEMORY_CAPABILITY = "agent_memory.v1"
"""``create_instance``'s ``max_memory`` (the agent's memory bound, enforced with a memory cgroup of its
own), ``sandbox_status``'s ``memory`` (whether this server can bound agents' memory, and why not), and
``agent_exited``'s ``reason: "memory"`` for an agent the bound killed (0.3.0). A server without it is
sent no ``max_memory``."""
NETWORK_CAPABILITY = "network.v1"
"""Every sandboxed agent in a network namespace of its own, out only through its egress proxy;
``create_instance``'s ``network`` field (the policy), ``list_instances``' and ``sandbox_status``'
``network`` (refusals), ``sandbox_status``' ``network_namespace`` (Issue 44). A server without it
would start the agent on the host's network: the client refuses such a launch."""
CAPABILITIES = (*REQUIRED_CAPABILITIES, RELOAD_CAPABILITY, SANDBOX_CAPABILITY, AGENT_SECRETS_CAPABILITY,
                AGENT_LIMITS_CAPABILITY, ATTACH_MANY_CAPABILITY, AGENT_MEMORY_CAPABILITY, NETWORK_CAPABILITY)


TURN_STATUSES_MAX = 1000
"""Instances one ``turn_statuses`` request may name (the reply stays far below the frame limit)."""
ATTACH_MANY_MAX = 4096
"""Instances one ``attach_many`` request may name (request and reply stay far below the frame limit)."""


class EventKind:
    """Kinds of frames on an ``attach`` stream (``data`` shape in comments)."""

    SESSION_UPDATE = "session_update"  # {turn_id, update: <ACP session update as JSON dict>}
    TURN_STARTED = "turn_started"  # {turn_id, text}
    TURN_ENDED = "turn_ended"  # {turn_id, stop_reason, error|None}
    PERMISSION_REQUEST = "permission_request"  # {request_id, turn_id, tool_call, options}
    # {exit_code, stderr_tail, signal?: name when killed by a signal kandev did not send,
    #  reason?: "memory" when its memory bound killed it (with max_memory, in bytes)}
    AGENT_EXITED = "agent_exited"
    AGENT_ERROR = "agent_error"  # {message}
    # An open permission request the server answered "cancelled" itself (a ``cancel`` op, or the
    # agent exited); a backend's own respond_permission is not echoed. Added with the detached bound.
    PERMISSION_CANCELLED = "permission_cancelled"  # {request_id, turn_id, reason: "cancel"|"agent_exited"}


OPS = [
    # --- unauthenticated -------------------------------------------------
    Op("identify", auth=False, doc="-> {server_identity, capabilities, protocol_version, unowned_period_s}"),
    Op(
        "prove",
        required={"challenge": bytes},
        auth=False,
        doc="server proves it holds the credential: -> {proofs: [HMAC(cred, challenge||identity||installation)]}",
    ),
    Op("auth_begin", auth=False, doc="-> {nonce: bytes}"),
    Op("auth_finish", required={"proof": bytes}, auth=False, doc="proof = HMAC(cred, 'auth'||nonce||identity)"),
    # --- ownership ---------------------------------------------------------
    # Which credential authenticated the connection matters (daemon.agentctl.ownership): the current
    # one may do everything; the one a still-unconfirmed rotation superseded may only ``rotate`` and
    # ``ownership_shutdown`` (anything else: ``superseded_credential``); any older one, nothing.
    Op("claim", doc="renew ownership (current credential); names no instance -> {unowned_period_s}"),
    Op(
        "ownership_shutdown",
        doc="stop every instance, then exit; current or superseded credential; while already stopping"
        " it succeeds again -> {stopped: [instance_id]}",
    ),
    Op(
        "rotate",
        optional={"proof": bytes},
        auth=False,  # authenticated in the handler: the superseded credential may rotate too
        doc="replace the credential (renews). On a connection authenticated by auth_finish, or with"
        " proof = connection_proof(cred, nonce of this connection's pending auth_begin, identity)."
        " Presented with the highest rotation's credential: a new rotation; with the one it superseded"
        " (unconfirmed): the same pair again -> {rotation_id, credential: bytes, replay}",
    ),
    Op(
        "confirm_rotation",
        required={"rotation_id": int},
        doc="the replacement of rotation_id is durably stored (connection authenticated with it); the"
        " superseded credential then authenticates nothing and its connections and streams are closed."
        " Earlier or repeated id: no-op; never issued: unknown_rotation -> {rotation_id, changed}",
    ),
    # --- instances -----------------------------------------------------------
    Op(
        "create_instance",
        required={"session_id": str, "task_id": str, "command": list, "cwd": str},
        optional={
            "env": dict,  # extra environment for the agent (never logged)
            "agent": str,  # agent name, for diagnostics
            "resume_session_id": str,  # ACP session/load instead of session/new
            "workspace_roots": list,  # file-operation reach; defaults to [cwd]
            # {policy: "required"|"off", writable: [path], readonly: [path], hidden: [path]}
            # (daemon.agentctl.sandbox.bubblewrap.SandboxRequest); absent: required, with nothing beyond cwd
            "sandbox": dict,
            # {VARIABLE: "/path" | "credential:NAME"}: the agent's secrets, by reference; the server
            # reads the values at spawn into this agent's environment only (daemon.agentctl.sandbox.agent_env)
            "secret_env": dict,
            # the agent's memory bound in bytes (agents.max_memory): its own memory cgroup; absent:
            # half the host's RAM (agent_memory.v1)
            "max_memory": int,
            # {mode: "allow-list"|"none"|"open", allow_hosts: [rule], host_ports: ["IP:PORT"]}: the
            # agent's network (daemon.agents.network.NetworkPolicy; network.v1); absent: the allow-list
            # with the agent's built-in provider hosts
            "network": dict,
        },
        doc="spawn the agent in its own process group (in its sandbox unless the policy is off; a"
        " required sandbox this server cannot make: sandbox_unavailable), ACP initialize +"
        " session/new|load -> {instance_id, pid, pid_start_time, pid_start_stamp, acp_session_id, modes,"
        " config_options, handshake_seq, sandboxed, network}; pid: the sandbox's bwrap process, the group leader;"
        " handshake_seq: the last seq appended before the answer (e.g. the history a session/load"
        " replays), so a backend that already stores the transcript attaches after it",
    ),
    # --- runtime configuration and context reset (docs/requirements.md#runtime-configuration-across-a-context-reset). Added ops, no new capability: adoption
    # requires every capability, and a backend meeting an older server gets unknown_op and falls back.
    Op(
        "set_mode",
        required={"instance_id": str, "mode_id": str},
        doc="ACP session/set_mode on the instance's current session; refused by the agent: agent_error"
        " -> {acp_session_id, mode_id, last_seq}; last_seq covers every update sent before the answer",
    ),
    Op(
        "set_config_option",
        required={"instance_id": str, "config_id": str, "value": (str, bool)},
        doc="ACP session/set_config_option (a model is the option with category 'model'); refused:"
        " agent_error -> {acp_session_id, config_options (the agent's authoritative list), last_seq}",
    ),
    Op(
        "reset_context",
        required={"instance_id": str},
        doc="a new ACP session (session/new) on the same agent process; prompts go to it from now on;"
        " refused or failed: the current session stays -> {acp_session_id, modes, config_options, last_seq}",
    ),
    # Added with the agent sandbox (capability sandbox.v1; an older server answers unknown_op and the
    # backend reports the sandbox unavailable there). Authenticated: identify names no path (AC-EXECUTORS-CONTROL-OWNERSHIP-001.11).
    Op(
        "sandbox_status",
        optional={"refresh": bool},
        doc="whether this server can sandbox agents (daemon.agentctl.sandbox.bubblewrap), probed again with refresh"
        " -> {available, reason|None, mechanism, bwrap, version, ipc_namespace, network_namespace, network:"
        " {refused, recent_refused}, memory: {bounded, hierarchy, cgroup, reason}} (network and its namespace since"
        " network.v1, memory since agent_memory.v1)",
    ),
    # Added with agents' own network namespaces (protocol 1.3, capability network.v1).
    Op(
        "network_status",
        required={"instance_id": str},
        doc="the instance's network (daemon.agentctl.egress) -> {mode, refused, recent_refused: [{host, port,"
        " reason, at}]}; an instance without a proxy (mode none, unsandboxed) -> {mode|None, refused: 0}",
    ),
    Op("prompt", required={"instance_id": str, "text": str}, doc="start a turn -> {turn_id}"),
    Op("cancel", required={"instance_id": str}, doc="ACP session/cancel for the current turn -> {}"),
    Op(
        "respond_permission",
        required={"instance_id": str, "request_id": str},
        optional={"option_id": str},
        doc="answer an open permission request; no option_id = cancelled -> {}",
    ),
    Op(
        "list_instances",
        doc="-> {instances: [{instance_id, session_id, task_id, pid, ..., next_seq, retained_events,"
        " attached, paused, detached_event_limit}]}; paused: the agent's output is held back because"
        " retained_events reached detached_event_limit while no stream is attached (AC-EXECUTORS-SURVIVAL-001.6);"
        " since 1.1 not_taken_over: what a re-exec could not carry over for the instance (usually empty)",
    ),
    Op("stop_instance", required={"instance_id": str}, doc="kill the group -> {stopped, already_absent}"),
    Op(
        "attach",
        required={"instance_id": str},
        optional={"after_seq": int, "batched": bool},
        stream=True,
        doc="event stream from after_seq (events <= after_seq are discarded) -> {instance_id, next_seq};"
            " batched: several events per frame ({events: [[seq, kind, data], ...]})",
    ),
    Op(
        "attach_many",
        required={"instances": list},
        stream=True,
        doc="protocol 1.2 (attach_many.v1): attach each of up to ATTACH_MANY_MAX [instance_id, after_seq]"
            " as attach does, on this one connection -> {attached: {instance_id: {next_seq,"
            " retained_events, stream}}, missing: [instance_id]}; frames {instance, events: [[seq, kind,"
            " data], ...]} and {instance, end: true} when that instance's stream ends; the stream ends"
            " when every one has",
    ),
    Op(
        "detach",
        required={"instance_id": str, "stream": str},
        doc="protocol 1.2 (attach_many.v1): end the instance's stream the token names (attach_many's"
            " answer), if it is still the instance's; a newer stream stays -> {detached}",
    ),
    Op(
        "ack_events",
        required={"instance_id": str, "seq": int},
        doc="the backend durably applied every event <= seq; the server may discard them -> {}",
    ),
    Op(
        "turn_status",
        required={"instance_id": str},
        doc="pure read -> {current_turn_id|None, outcomes: [{turn_id, stop_reason, error}]}",
    ),
    Op(
        "turn_statuses",
        required={"instance_ids": list},
        doc="protocol 1.2: turn_status of up to TURN_STATUSES_MAX instances in one pure read -> {statuses:"
        " {instance_id: {current_turn_id|None, outcomes}}, missing: [instance_id]} (missing: no such"
        " instance, what turn_status answers with not_found)",
    ),
    Op("ack_turn", required={"turn_id": str}, doc="discard a retained outcome; unknown id is a no-op -> {}"),
    # --- reload (protocol 1.1, capability reload.v1) -------------------------------------
    Op(
        "reload",
        doc="re-execute the installed code with this server's state handed over; answers at once ->"
        " {attempt, version, pid}; follow server_info's reload.last_attempt / last_outcome ('reexecuted' |"
        " 'refused', last_reason) for the outcome. Every connection is closed during the re-exec: a"
        " request refused with 'reloading' never ran and may be sent again",
    ),
    Op(
        "server_info",
        doc="-> {version, pid, reload: {started_at, reexec_count, last_reexec_at, last_from_version,"
        " last_pause_ms, attempts, last_attempt, last_outcome, last_reason, last_outcome_at, in_progress}}",
    ),
]

TABLE = OpTable(PROTOCOL, VERSION, OPS, capabilities=CAPABILITIES)
