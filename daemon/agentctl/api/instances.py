"""The instance ops: thin handlers that read the request, call ``InstanceService`` or the
``Instance`` (``daemon.agentctl.instance.instance``) and shape the answer.

``create_instance`` checks every field of the request here (a typed ``invalid_argument`` naming
the field, nothing started); ``sandbox_status``, ``set_mode``, ``set_config_option``,
``reset_context``, ``prompt``, ``cancel``, ``respond_permission``, ``list_instances`` and
``stop_instance``. Unknown instance ids are ``not_found``, except for ``stop_instance``, where an
absent instance counts as stopped (``already_absent``).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from daemon.agentctl.egress.host import EgressHost
from daemon.agentctl.instance.process import InstanceSpec
from daemon.agentctl.instances import InstanceService
from daemon.agentctl.sandbox_host import SandboxHost
from daemon.agentctl.server_context import ServerContext
from daemon.agents import memory
from daemon.core import faults
from daemon.core.journal import log_event
from ipc.connection import ConnectionContext
from ipc.errors import ErrorCode, IpcError
from ipc.server import Handler

MAX_TEXT = 4 * 1024 * 1024
"""The longest prompt text, in characters."""


def _bad(message: str) -> IpcError:
    return IpcError(ErrorCode.INVALID_ARGUMENT, message)


def _check_str(name: str, value: Any, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not allow_empty) or "\0" in value:
        raise _bad(f"create_instance: '{name}' must be a non-empty string without NUL")
    return value


def _check_str_list(name: str, value: Any, *, allow_empty: bool) -> list[str]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise _bad(f"create_instance: '{name}' must be a{'' if allow_empty else ' non-empty'} list of strings")
    return [_check_str(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _check_env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad("create_instance: 'env' must be a map of strings")
    env: dict[str, str] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise _bad("create_instance: every 'env' name must be a non-empty string without '=' or NUL")
        if not isinstance(v, str) or "\0" in v:
            raise _bad(f"create_instance: 'env' value of {k!r} must be a string without NUL")
        env[k] = v
    return env


def spec_from_request(args: dict[str, Any]) -> InstanceSpec:
    """The ``InstanceSpec`` a ``create_instance`` request asks for (every field checked)."""
    cwd = _check_str("cwd", args["cwd"])
    if not os.path.isabs(cwd) or not os.path.isdir(cwd):
        raise _bad(f"create_instance: cwd {cwd!r} is not an absolute path of an existing directory")
    resume = args.get("resume_session_id")
    return InstanceSpec(
        instance_id=uuid.uuid4().hex,
        session_id=_check_str("session_id", args["session_id"]),
        task_id=_check_str("task_id", args["task_id"]),
        command=_check_str_list("command", args["command"], allow_empty=False),
        cwd=cwd,
        env=_check_env(args.get("env", {})),
        agent=args.get("agent"),
        resume_session_id=_check_str("resume_session_id", resume) if resume is not None else None,
        workspace_roots=_check_str_list("workspace_roots", args.get("workspace_roots", []), allow_empty=True),
    )


def _max_memory(args: dict[str, Any]) -> int:
    """``create_instance``'s ``max_memory`` (bytes): 64 MiB to this host's RAM; absent, half the RAM."""
    value = args.get("max_memory")
    if value is None:
        return memory.default_bound()
    if isinstance(value, bool) or not isinstance(value, int) or not memory.in_range(value):
        raise _bad(f"create_instance: 'max_memory' = {value!r:.40} is out of range: accepted {memory.accepted()}")
    return value


def handlers(server: ServerContext, instances: InstanceService, sandbox_host: SandboxHost,
             egress: EgressHost) -> dict[str, Handler]:
    """The instance ops' handlers."""

    async def create_instance(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        server.refuse_if_shutting_down("create_instance")
        spec = spec_from_request(args)
        inst = await instances.create(spec, args.get("sandbox"), args.get("secret_env"), _max_memory(args),
                                      args.get("network"))
        return {
            "instance_id": spec.instance_id,
            "pid": inst.pid,
            "pid_start_time": inst.group.pid_start_time,
            "pid_start_stamp": inst.group.pid_start_stamp,
            "acp_session_id": inst.acp_session_id,
            "modes": inst.session_info.get("modes"),
            "config_options": list(inst.session_info.get("config_options") or []),
            "handshake_seq": inst.handshake_seq,
            "sandboxed": spec.sandboxed,
            "network": (spec.network or {}).get("policy"),
        }

    async def sandbox_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        support = sandbox_host.support
        if support is None or args.get("refresh"):
            support = await sandbox_host.probe()
        return {**support.to_wire(), "memory": sandbox_host.memory.to_wire(), "network": egress.totals()}

    def network_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        inst = server.get(args["instance_id"])
        stats = egress.stats(inst.instance_id)
        if stats is not None:
            return stats
        policy = (inst.spec.network or {}).get("policy") or {}
        return {"mode": policy.get("mode"), "refused": 0, "recent_refused": []}

    async def set_mode(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        return await server.get(args["instance_id"]).set_mode(_check_str("mode_id", args["mode_id"]))

    async def set_config_option(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        value = args["value"]
        if isinstance(value, str):
            value = _check_str("value", value)
        return await server.get(args["instance_id"]).set_config_option(
            _check_str("config_id", args["config_id"]), value
        )

    async def reset_context(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        server.refuse_if_shutting_down("reset_context")
        inst = server.get(args["instance_id"])
        result = await inst.reset_context()
        log_event(
            "instance_context_reset",
            f"instance {inst.instance_id}: new ACP session {inst.acp_session_id} (context reset)",
            INSTANCE_ID=inst.instance_id,
            SESSION_ID=inst.spec.session_id,
            TASK_ID=inst.spec.task_id,
            PID=inst.pid,
        )
        return result

    def prompt(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        inst = server.get(args["instance_id"])
        text = args["text"]
        if len(text) > MAX_TEXT:
            raise _bad(f"prompt: text longer than {MAX_TEXT} characters")
        return {"turn_id": inst.prompt(text)}

    async def cancel(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await server.get(args["instance_id"]).cancel()
        return {}

    def respond_permission(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        server.get(args["instance_id"]).respond_permission(args["request_id"], args.get("option_id"))
        return {}

    async def list_instances(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        await faults.delay("agentctl_slow_enumeration")  # test fault, off unless $KANDEV_FAULT says so
        return {"instances": [{**inst.describe(), "network": egress.stats(inst.instance_id)}
                              for inst in server.instances.values()]}

    async def stop_instance(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        faults.hit("agentctl_stop_fails")  # test fault, off unless $KANDEV_FAULT says so
        if not await instances.stop(args["instance_id"]):
            return {"stopped": False, "already_absent": True}
        return {"stopped": True, "already_absent": False}

    return {
        "create_instance": create_instance, "sandbox_status": sandbox_status, "network_status": network_status, "set_mode": set_mode,
        "set_config_option": set_config_option, "reset_context": reset_context, "prompt": prompt,
        "cancel": cancel, "respond_permission": respond_permission, "list_instances": list_instances,
        "stop_instance": stop_instance,
    }
