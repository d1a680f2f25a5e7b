"""The new process image after a reload: read the handed-over state and go on serving.

``kandev-agentctl --resume-state-fd N`` is how ``daemon.agentctl.reload.reexec`` execs
the installed code. ``load`` reads and decodes the memfd (then closes it: the
credentials and agents' environments it holds exist nowhere else but in memory)
and rebuilds the launch settings; ``main`` then builds the server with
``AgentctlServer.from_handover``, takes every agent's pipes back and serves on
the inherited listening socket (``AgentctlServer.start_handed_over``) before it
reports ready. ``reexecuted`` records the reload in the history that
``server_info`` and the status file report, and writes the journal entries: one
``agentctl_reexecuted`` entry, and one ``handover_incomplete`` entry (priority
warning) per instance with something the new code could not take over, which
``list_instances`` also shows.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from daemon.agentctl import launch
from daemon.agentctl.handover import HandoverError, ServerHandover, decode, from_fields, read_memfd
from daemon.core.journal import log_event
from daemon.core.version import VERSION


@dataclass
class Resumed:
    state: ServerHandover
    config: launch.LaunchConfig
    lost: list[str]


def load(state_fd: int) -> Resumed:
    """Decode the state in ``state_fd`` (closed afterwards). Raises HandoverError."""
    try:
        data = read_memfd(state_fd)
    except OSError as exc:
        raise HandoverError(f"cannot read the handed-over state (fd {state_fd}): {exc}") from None
    finally:
        try:
            os.close(state_fd)
        except OSError:
            pass
    state = decode(data)
    lost: list[str] = []
    config = from_fields(launch.LaunchConfig, state.launch, "launch", lost)
    return Resumed(state, config, state.lost + lost)


def listener(state: ServerHandover) -> socket.socket:
    """The listening socket the previous image kept open across the exec."""
    sock = socket.socket(fileno=state.listen_fd)
    os.set_inheritable(state.listen_fd, False)
    return sock


def close_inherited(state: ServerHandover) -> None:
    """On a failed resume, do not keep the agents' pipes or the socket open for nothing."""
    for fd in state.fds():
        try:
            os.close(fd)
        except OSError:
            pass


def reexecuted(server: object, resumed: Resumed) -> None:
    """Record and report a completed re-exec (called once the new image serves)."""
    state = resumed.state
    history = state.reload
    pause_ms = (time.monotonic() - state.quiesced_at) * 1000.0
    history.reexec_count += 1
    history.last_reexec_at = time.time()
    history.last_from_version = state.from_version
    history.last_pause_ms = round(pause_ms, 1)
    history.last_outcome = "reexecuted"
    history.last_reason = None
    history.last_outcome_at = history.last_reexec_at
    server.write_reload_status()  # type: ignore[attr-defined]
    log_event(
        "agentctl_reexecuted",
        f"control server {state.server_identity} re-executed in place: version {state.from_version} -> {VERSION},"
        f" {len(state.instances)} instance(s) taken over, serving again after {pause_ms:.0f} ms",
        FROM_VERSION=state.from_version,
        TO_VERSION=VERSION,
        INSTANCES=len(state.instances),
        PAUSE_MS=f"{pause_ms:.0f}",
        REEXEC_COUNT=history.reexec_count,
        SERVER_IDENTITY=state.server_identity,
        PID=os.getpid(),
    )
    if resumed.lost:
        log_event("handover_incomplete", "the re-executed control server could not take over: "
                  + "; ".join(resumed.lost), priority=4, SERVER_IDENTITY=state.server_identity)
    for inst in getattr(server, "instances", {}).values():
        if inst.not_taken_over:
            log_event(
                "handover_incomplete",
                f"instance {inst.instance_id}: the re-executed control server could not take over: "
                + "; ".join(inst.not_taken_over),
                priority=4,
                INSTANCE_ID=inst.instance_id,
                SESSION_ID=inst.spec.session_id,
                TASK_ID=inst.spec.task_id,
            )
