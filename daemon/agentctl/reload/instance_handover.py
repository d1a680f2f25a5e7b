"""One instance across a re-exec of the control server: pause, capture, restore, resume.

Owns the instance's side of the hand-over (``daemon.agentctl.reload.reexec`` captures,
``daemon.agentctl.reload.resume`` restores; the format is ``daemon.agentctl.handover``'s and does not
change here):

- ``pause``: stop reading the agent at a message boundary (its stderr and stdout wait in their
  pipes); ``resume_after_refusal`` reads it again where it stopped;
- ``blocker``: what still moves, until the instance can be captured as it is;
- ``capture`` / ``fds``: the ``InstanceHandover`` and the descriptors it names;
- ``restore`` / ``resume_pipes``: the instance of the previous process image, then its pipes,
  requests in flight, open permission requests and open turn, exactly where it stopped;
  ``restore_memory``: its memory cgroup, whose path the spec carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acp.schema import PromptResponse

from daemon.agentctl.handover import InstanceHandover, RequestHandover, from_fields, to_plain
from daemon.agentctl.instance import acp_internals, pipe_internals
from daemon.agentctl.instance.conversation import Permission, rpc_key
from daemon.agentctl.instance.instance import HANDSHAKE_TIMEOUT, Instance, InstanceState
from daemon.agentctl.instance.memory import AgentMemory
from daemon.agentctl.instance.pipe import AGENT_STDOUT_LIMIT
from daemon.agentctl.instance.process import SPEC_NOT_HANDED_OVER, AdoptedProcess, InstanceSpec
from daemon.agentctl.sandbox.memory_cgroups import MemoryHost

log = logging.getLogger("kandev.agentctl.instance")


def pause(inst: Instance) -> asyncio.Task[Any] | None:
    """Stop reading the agent at a message boundary: the connection's receive loop is cancelled
    (a line being read or held back by the detached bound stays in the transport). Returns the
    stopped loop's task (await it) or None if nothing was reading."""
    if inst.state is InstanceState.RUNNING and inst.stderr_sink is not None and inst.stderr_handover_fd is None:
        inst.stderr_handover_fd = inst.stderr_sink.pause()  # what the agent writes now waits in the pipe
    if inst.conn is None or not acp_internals.receiving(inst.conn):
        return None
    inst.reading_paused_for_handover = True
    if inst.transport is not None:  # and the pipe: what the agent writes now waits in the pipe
        inst.pipe_paused_for_handover = inst.transport.stop_reading_pipe()
    return acp_internals.stop_receiving(inst.conn)


def resume_after_refusal(inst: Instance) -> None:
    """A refused reload: read the agent again, from where ``pause`` stopped."""
    if inst.stderr_handover_fd is not None:
        inst.start_stderr_sink(inst.stderr_handover_fd)
    if inst.reading_paused_for_handover and inst.conn is not None and not inst.gone:
        inst.reading_paused_for_handover = False
        if inst.pipe_paused_for_handover and inst.process is not None:
            pipe_internals.resume_pipe(inst.process.stdout)
        inst.pipe_paused_for_handover = False
        if not acp_internals.receiving(inst.conn):
            acp_internals.restart_receiving(inst.conn)


def blocker(inst: Instance) -> str | None:
    """None once this instance can be captured as it is; otherwise what is still moving.

    Reading is paused first; then every write to the agent must be on its way (nothing of ours
    in a send or in the pipe transport's buffer), the open turn's session/prompt must be out
    and unanswered (or the turn ended), and the only requests of the agent we have not
    answered must be permission requests nobody answered yet: those travel, answers being
    written do not.
    """
    if inst.state in (InstanceState.STARTING, InstanceState.STOPPING):
        return f"instance {inst.instance_id} is {inst.state.value}"
    conn, transport = inst.conn, inst.transport
    if inst.state is not InstanceState.RUNNING or conn is None or transport is None:
        return None
    if acp_internals.receiving(conn):
        return f"instance {inst.instance_id}: still reading the agent"
    if not transport.writes_settled:
        return f"instance {inst.instance_id}: a write to the agent's stdin is not done (does it read its stdin?)"
    pending = acp_internals.pending_request_ids(conn)
    if any(rid not in transport.requests_sent for rid in pending):
        return f"instance {inst.instance_id}: a request to the agent is being sent"
    turn_task = inst.prompt_task
    turn_in_flight = "session/prompt" in (transport.requests_sent.get(rid) for rid in pending)
    if inst.current_turn_id is not None and turn_task is not None and not turn_task.done() and not turn_in_flight:
        return f"instance {inst.instance_id}: turn {inst.current_turn_id} is being sent or ended"
    waiting = {p.rpc_id for p in inst.permissions.waiting()}
    for key, method in inst.incoming_open.items():
        if key not in waiting:
            return f"instance {inst.instance_id}: the agent's {method} request is being answered"
    return None


def fds(inst: Instance) -> list[int]:
    """The fds ``capture`` names: the agent's stdout and stdin pipes, while it runs."""
    proc = inst.process
    if inst.state is not InstanceState.RUNNING or inst.conn is None or proc is None:
        return []
    named = (pipe_internals.reader_fd(proc.stdout), pipe_internals.writer_fd(proc.stdin), inst.stderr_handover_fd)
    return [fd for fd in named if fd is not None]


def capture(inst: Instance) -> InstanceHandover:
    """The instance as the next process image needs it (call once ``blocker`` is None;
    synchronous, so nothing changes while it runs)."""
    proc, conn, transport = inst.process, inst.conn, inst.transport
    live = inst.state is InstanceState.RUNNING and conn is not None and transport is not None
    requests: list[RequestHandover] = []
    permissions = []
    stdout_fd = stdin_fd = None
    unread = b""
    if live:
        assert conn is not None and transport is not None and proc is not None
        for rid in acp_internals.pending_request_ids(conn):
            method = transport.requests_sent.get(rid, "")
            turn = inst.current_turn_id if method == "session/prompt" else None
            requests.append(RequestHandover(rid, method, turn))
        permissions = inst.permissions.handover()
        stdout_fd = pipe_internals.reader_fd(proc.stdout)
        stdin_fd = pipe_internals.writer_fd(proc.stdin)
        unread = transport.unread(pipe_internals.buffered_bytes(proc.stdout))
    return InstanceHandover(
        spec={k: v for k, v in to_plain(inst.spec).items() if k not in SPEC_NOT_HANDED_OVER},
        state=inst.state.value,
        pid=inst.pid,
        pid_start_time=inst.group.pid_start_time,
        exit_code=inst.exit_code,
        reaped_returncode=proc.returncode if proc is not None else None,
        acp_session_id=inst.acp_session_id,
        session_info=to_plain(inst.session_info),
        handshake_seq=inst.handshake_seq,
        detached_event_limit=inst.detached_event_limit,
        limit_armed=inst.log.limit is not None,
        current_turn_id=inst.current_turn_id,
        outcomes=[dict(o) for o in inst.turns.outcomes.values()],
        next_seq=inst.log.next_seq,
        events=[[e.seq, e.kind, e.data] for e in inst.log.retained()],
        stdout_fd=stdout_fd,
        stdin_fd=stdin_fd,
        unread=unread,
        next_request_id=acp_internals.next_request_id(conn) if conn is not None else 0,
        requests=requests,
        permissions=permissions,
        stderr_path=str(inst.stderr_path),
        stderr_fd=inst.stderr_handover_fd if live else None,
        not_taken_over=list(inst.not_taken_over),
        **inst.group.identity_handover(),
    )


def restore_memory(inst: Instance, host: MemoryHost) -> None:
    """Keep the restored agent's memory cgroup: the one the spec names, if it is where this image,
    from its own cgroup and the instance id, finds it (``AgentMemory.adopt``)."""
    path = inst.spec.memory_cgroup
    if path is None:
        return
    inst.memory = AgentMemory.adopt(host, inst.instance_id, path, inst.spec.max_memory or 0)
    if inst.memory is None:
        where = f"below {host.base}" if host.base else f"nowhere ({host.reason})"
        inst.not_taken_over.append(f"its memory cgroup {path} (this image makes agents' cgroups {where}): the"
                                   " agent stays in it, but a kill by its bound is reported as a plain signal")


def restore(
    h: InstanceHandover,
    *,
    agent_log_dir: str | os.PathLike[str],
    turn_ids: Callable[[], str],
    on_change: Callable[[Instance], None] | None = None,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
) -> Instance:
    """The instance of a previous process image, without its pipes yet (``resume_pipes``)."""
    lost: list[str] = []
    spec = from_fields(InstanceSpec, h.spec, "spec", lost)
    inst = Instance(spec, agent_log_dir=agent_log_dir, turn_ids=turn_ids, on_change=on_change,
                    handshake_timeout=handshake_timeout, detached_event_limit=h.detached_event_limit)
    inst.state = InstanceState(h.state)
    inst.group.pid, inst.group.pid_start_time, inst.exit_code = h.pid, h.pid_start_time, h.exit_code
    inst.acp_session_id = h.acp_session_id
    inst.session_info = dict(h.session_info)
    inst.handshake_seq = h.handshake_seq
    inst.turns.current = h.current_turn_id
    inst.turns.outcomes = OrderedDict((str(o.get("turn_id")), dict(o)) for o in h.outcomes)
    inst.log.restore(h.next_seq, [(int(e[0]), str(e[1]), e[2]) for e in h.events])
    if h.limit_armed:
        inst.log.set_limit(h.detached_event_limit)
    inst.stderr_path = Path(h.stderr_path)
    inst.not_taken_over = list(h.not_taken_over) + lost
    if inst.state is InstanceState.EXITED:
        inst.exited.set()
    return inst


async def resume_pipes(inst: Instance, h: InstanceHandover) -> None:
    """Take the agent's pipes back and go on exactly where the previous image stopped: unread
    bytes first, our requests still awaiting answers, the agent's open permission requests
    (their handlers answer them when a backend does), the open turn."""
    if inst.state is not InstanceState.RUNNING or inst.pid is None:
        return
    lost = inst.group.resume_identity(h.sandbox_init_pid, h.sandbox_init_start_time, h.pid_start_ticks,
                                      h.sandbox_init_start_ticks)
    if lost is not None:
        inst.not_taken_over.append(lost)
    if h.stderr_fd is not None:
        inst.start_stderr_sink(h.stderr_fd)
    reader, writer = await pipe_internals.adopt_pipes(h.stdout_fd, h.stdin_fd, h.unread, AGENT_STDOUT_LIMIT)
    inst.group.proc = AdoptedProcess(inst.pid, reader, writer, h.reaped_returncode)
    conn = inst.connect(reader, writer)
    transport = inst.transport
    assert transport is not None
    # Synchronous from here on: the connection's receive loop has not run yet.
    answers = acp_internals.restore_requests(conn, h.next_request_id, [r.rpc_id for r in h.requests])
    turn_resumed = False
    for request in h.requests:
        transport.requests_sent[request.rpc_id] = request.method
        answer = answers[request.rpc_id]
        if request.method == "session/prompt" and request.turn_id and request.turn_id == inst.current_turn_id:
            inst.prompt_task = asyncio.create_task(
                inst.finish_turn(request.turn_id, _prompt_response(answer)), name=f"agentctl.turn.{request.turn_id}"
            )
            turn_resumed = True
        else:
            inst.not_taken_over.append(f"the answer to {request.method or 'a request'} sent before the re-exec")
            asyncio.create_task(_discard_answer(inst.instance_id, request.method, answer))
    for p in h.permissions:
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        rpc = rpc_key(p.message.get("id"))
        inst.permissions.add(Permission(p.request_id, list(p.option_ids), future, rpc, p.turn_id, p.tool_call_id,
                                        p.message))
        inst.incoming_open[rpc] = "session/request_permission"
    for p in h.permissions:
        acp_internals.replay_request(conn, p.message)
    if inst.current_turn_id is not None and not turn_resumed:
        inst.not_taken_over.append(f"turn {inst.current_turn_id} (its prompt request was not in flight)")
        inst.end_turn(inst.current_turn_id, "error", "the control server re-executed and could not match"
                      " this turn's answer")


async def _prompt_response(answer: asyncio.Future[Any]) -> PromptResponse:
    return PromptResponse.model_validate(await answer)


async def _discard_answer(instance_id: str, method: str, answer: asyncio.Future[Any]) -> None:
    with contextlib.suppress(Exception):
        await answer
    log.warning("instance %s: the answer to %s sent before the re-exec arrived; nobody waits for it",
                instance_id, method or "a request")
