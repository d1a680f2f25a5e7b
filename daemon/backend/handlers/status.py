"""Handlers of the backend's own ops: ``status``, ``config_show``, ``shutdown``, ``agentctl_reload`` and
``control_server_retry`` (``api.TABLE``): the backend, its control servers and their version."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from sqlalchemy.exc import OperationalError

from daemon.agentctl.client.handshake import identify
from daemon.api.ops import BackendState, LinkObserved, LinkState
from daemon.backend.control.launcher import ControlServerHandle
from daemon.backend.lifetime.context import BackendContext
from daemon.backend.lifetime.server_upgrade import ServerUpgrade
from daemon.backend.sessions import agent_launch, lifecycle
from daemon.config.view import config_view
from daemon.core.version import VERSION
from ipc.errors import ErrorCode, IpcError
from ipc.server import ConnectionContext, Handler


def handlers(backend: BackendContext, upgrade: ServerUpgrade) -> dict[str, Handler]:
    b = backend

    async def control_link(handle: ControlServerHandle | None, link: dict[str, Any]) -> dict[str, Any]:
        """The control server's link (``link``: its snapshot), and whether the server answers when
        its link says running."""
        if handle is not None and link["state"] == LinkState.RUNNING.value:
            # running as far as its link can tell (its process is there): does it answer?
            try:
                if await identify(handle.endpoint, timeout=1.0) is None:
                    # running, but it does not answer (for a moment while it re-executes)
                    link["state"] = LinkObserved.RELOADING if upgrade.reloading else LinkObserved.UNREACHABLE
            except IpcError as exc:
                link["state"] = (LinkObserved.RELOADING if exc.code == ErrorCode.RELOADING
                                 else LinkObserved.UNREACHABLE)
        if link["state"] == LinkState.RUNNING.value:
            await upgrade.refresh()
        return link

    async def op_status(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        # One moment: the state and the server (its link, its identity) as they were together. A
        # start that finishes, or a server replaced, while the questions below are out: the two
        # questions that depend on the server are asked once more, so one such change never pairs
        # READY with no server, or one server's pid with another's identity and version (a second
        # change during that second round is not caught).
        def moment() -> tuple[BackendState, ControlServerHandle | None, str | None, dict[str, Any]]:
            return b.state, b.handle, b.servers.server_identity, b.link.snapshot()

        state, handle, identity, link = moment()
        # the three questions to other parties at once: a status call waits for the slowest, not the sum
        link, sandbox, store = await asyncio.gather(
            control_link(handle, link), agent_launch.sandbox_status(b), b.store_care.status())
        if b.handle is not handle:
            state, handle, identity, link = moment()
            link, sandbox = await asyncio.gather(control_link(handle, link), agent_launch.sandbox_status(b))
        report = b.report
        return {
            "backend": {
                "pid": os.getpid(),
                "version": VERSION,
                "socket": b.socket_path,
                "home": str(b.paths.home),
                "state": state,
                "config": b.config.source,  # the file it runs with (None: no file, defaults)
            },
            "capability": {
                "state": b.capability.state,
                "reason": b.capability.reason,
                "detail": b.capability.detail,
                "supervisor": b.capability.supervisor,
                # features.auto_resume: the sessions a restart interrupted get their agent back by themselves
                "auto_resume": b.config.features.auto_resume,
            },
            "control_server": {
                **link,
                "pid": handle.pid if handle else None,
                "server_identity": identity if handle else None,
                "endpoint": handle.endpoint if handle else None,
                "mode": handle.mode if handle else b.launcher.mode,
                "log_path": handle.log_path if handle else None,
                # running and installed versions, reload ability and history (Issue 15)
                **upgrade.status(),
                "passthrough": {**b.passthrough_link.snapshot(),
                                "pid": b.passthrough_handle.pid if b.passthrough_handle else None},
            },
            "recovery": {
                "retracked": len(report.retracked),
                "not_retracked": len(report.not_retracked),
                # of those, the ones still without an agent (resumed ones no longer count)
                "without_agent": sum(1 for sid in report.not_retracked if sid not in b.executions.executions),
                "stopped_with_backend": len(report.stopped_with_backend),
                # of those, the ones neither resumed (by hand or automatically) nor being resumed
                "stopped_without_agent": sum(1 for sid in report.stopped_with_backend
                                             if sid not in b.executions.executions and sid not in b.auto_resume_pending),
                "reasons": dict(report.not_retracked),
                "stopped_orphans": len(report.stopped_orphans),
                "duration_ms": round(report.duration_ms, 1),
            },
            "adoption": {"outcome": report.adoption.outcome, "reason": report.adoption.reason},
            "sandbox": sandbox,
            # whether each agent runs in a memory cgroup of its own, bounded (agents.max_memory), and why not
            "memory": agent_launch.memory_status(b.config, sandbox.pop("memory", None)),
            "store": store,
        }

    async def op_config_show(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev agents``, ``kandev doctor``: the configuration this backend runs with, its key
        files checked now as this backend's user (Issue 46 Why 3)."""
        return {**await asyncio.to_thread(config_view, b.config), "pid": os.getpid()}

    async def op_store_vacuum(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev store vacuum``: give the store's free pages back to the filesystem."""
        return await asyncio.to_thread(b.store_care.vacuum)

    async def op_agentctl_reload(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev agentctl reload``: the control server re-executes the installed code in place."""
        if b.state != BackendState.READY:
            raise IpcError(ErrorCode.UNAVAILABLE, f"backend is {b.state}; retry shortly", True)
        result = await upgrade.reload()
        if result["outcome"] != "reexecuted":
            raise IpcError("reload_refused", f"the control server refused to reload: {result['reason']};"
                           f" version {result['version']} keeps serving (see journal KANDEV_EVENT=reload_refused)",
                           False)
        return result

    async def op_shutdown(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """Stop gracefully; say how many agents and running turns the stop ends (``turns``), and the
        survival switch (``survival``: enabled, disabled, unavailable), so the CLI can say how to
        keep them next time."""
        agents = len(b.executions.executions)
        b.stop_agents_at_shutdown = bool(args.get("agents", False))
        stopping = lifecycle.stopping_with_backend(b)
        turns = await asyncio.to_thread(lifecycle.open_turns, b.store, list(stopping))
        b.shutdown_requested.set()
        return {"ok": True, "detach": b.enabled and not b.stop_agents_at_shutdown, "agents": agents,
                "turns": turns, "survival": b.capability.state}

    async def op_control_server_retry(ctx: ConnectionContext, args: dict[str, Any]) -> dict[str, Any]:
        """``kandev up`` with a backend that runs: try again where it gave up restarting a server."""
        retried = b.servers.retry()
        return {"retried": retried, "state": b.link.state.value,
                "passthrough_state": b.passthrough_link.state.value}

    return {
        "status": op_status,
        "config_show": op_config_show,
        "shutdown": op_shutdown,
        "agentctl_reload": op_agentctl_reload,
        "control_server_retry": op_control_server_retry,
        "store_vacuum": op_store_vacuum,
    }


def out_of_space_reported(backend: BackendContext, table: dict[str, Handler]) -> dict[str, Handler]:
    """Every handler of ``table``, with a store write that failed for want of space reported
    (``store_out_of_space`` in the journal and ``kandev status``) and answered with the retryable
    error ``store_out_of_space`` instead of an internal error (Issue 21 item 5); a database server
    that cannot be reached, with the retryable ``store_unreachable`` (Issue 47 item 5)."""
    space = backend.store_care.space

    def wrap(handler: Handler) -> Handler:
        async def handle(ctx: ConnectionContext, args: dict[str, Any]) -> Any:
            try:
                return await handler(ctx, args)
            except IpcError:
                raise
            except Exception as exc:
                if space.failed(exc):
                    where = space.state.path if space.state is not None else "the store"
                    raise IpcError("store_out_of_space", f"the store at {where} is out of space; nothing was"
                                   " written: free some space and retry", True) from exc
                if isinstance(exc, OperationalError) and backend.store.engine.dialect.name != "sqlite":
                    raise IpcError("store_unreachable", "the database cannot be reached"
                                   f" ({type(getattr(exc, 'orig', None) or exc).__name__}); agents keep running and"
                                   " the backend reconnects: retry shortly (kandev status says when it is back)",
                                   True) from exc
                raise
        return handle

    return {name: wrap(handler) for name, handler in table.items()}
