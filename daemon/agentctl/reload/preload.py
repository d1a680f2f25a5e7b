"""Everything the control server will ever run is imported before it reports ready (Issue 15).

A package upgrade replaces the files under the server while it runs. A module
the server imported already is in memory and keeps running as it was loaded; a
module imported *later* would come from the new version (mixed code in one
process). So the server imports every module it can need up front
(``import_everything``, before ``READY=1``), and ``LateImportWatch`` (installed
right after ``READY=1``) reports any import that still happens later: a module
outside the Python standard library imported late is logged as a warning
(``KANDEV_EVENT=agentctl_late_import``, ``MODULE=``), so a gap in the list below
shows up in tests and in production logs instead of silently mixing versions.
The new code reaches the process only by a re-exec (``daemon.agentctl.reload.reexec``),
whose preflight runs ``import_everything`` first.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from collections.abc import Callable

MODULES = (
    # the control server itself
    "daemon.agentctl.instance.acp_internals",
    "daemon.agentctl.instance.logs",
    "daemon.agentctl.instance.pipe",
    "daemon.agentctl.instance.process",
    "daemon.agentctl.auth",
    "daemon.agentctl.connection_auth",
    "daemon.agentctl.instance.conversation",
    "daemon.agentctl.instance.events",
    "daemon.agentctl.api.events",
    "daemon.agentctl.handover",
    "daemon.agentctl.instance.instance",
    "daemon.agentctl.reload.instance_handover",
    "daemon.agentctl.instances",
    "daemon.agentctl.api.instances",
    "daemon.agentctl.launch",
    "daemon.agentctl.main",
    "daemon.agentctl.ownership",
    "daemon.agentctl.api.ownership",
    "daemon.agentctl.instance.pipe_internals",
    "daemon.agentctl.reload.preflight",
    "daemon.agentctl.protocol",
    "daemon.agentctl.reload.reexec",
    "daemon.agentctl.api.reload",
    "daemon.agentctl.reload.client",
    "daemon.agentctl.reload.status",
    "daemon.agentctl.reload.resume",
    "daemon.agentctl.sandbox.bubblewrap",
    "daemon.agentctl.sandbox.network",
    "daemon.agentctl.sandbox_host",
    "daemon.agentctl.egress.host",
    "daemon.agentctl.egress.listener",
    "daemon.agentctl.egress.proxy",
    "daemon.agentctl.egress.request",
    "daemon.agents.network",
    "daemon.agentctl.server",
    "daemon.agentctl.server_context",
    "daemon.config.settings",
    "daemon.config.agentctl",
    "daemon.config.keys",
    "daemon.core.faults",
    "daemon.core.journal",
    "daemon.core.limits",
    "daemon.host.paths",
    "daemon.store",
    "daemon.store.states",
    "daemon.core.task_dump",
    "daemon.core.version",
    # the IPC layer
    "ipc",
    "ipc.aio",
    "ipc.connection",
    "ipc.errors",
    "ipc.framing",
    "ipc.hello",
    "ipc.listener",
    "ipc.peercred",
    "ipc.schema",
    "ipc.server",
    "ipc.server_protocol",
    # the ACP SDK, its schema and what its connection uses per message
    "acp",
    "acp.client.connection",
    "acp.client.router",
    "acp.connection",
    "acp.exceptions",
    "acp.helpers",
    "acp.interfaces",
    "acp.meta",
    "acp.router",
    "acp.schema",
    "acp.task",
    "acp.task.sender",
    "acp.task.supervisor",
    "acp.telemetry",
    "acp.utils",
    "pydantic",
    "pydantic_core",
    # third-party modules used at run time
    "msgpack",
    "psutil",
    # standard-library modules imported lazily by the code above
    "asyncio.subprocess",
    "asyncio.unix_events",
    "concurrent.futures.thread",
    "encodings.idna",
    "json.decoder",
    "json.encoder",
    "logging.handlers",
    "subprocess",
)
OPTIONAL_MODULES = (
    "systemd.journal",  # daemon.core.journal sends through it when a journal is present
    "sdnotify",  # main's notifier, under systemd
    "seccomp",  # libseccomp's bindings: the agents' system-call filter (sandbox.seccomp_filter) imports them lazily
)

_EVENT = "agentctl_late_import"


def import_everything() -> list[str]:
    """Import every module the server needs; returns the optional ones that are not installed.
    A required module that fails to import raises (a preflight then refuses the reload)."""
    for name in MODULES:
        importlib.import_module(name)
    missing = []
    for name in OPTIONAL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    warm_up()
    return missing


def warm_up() -> None:
    """Run once what builds lazily on first use (pydantic validators of the models the connection
    parses, the JSON codec), so that first use after ready imports nothing."""
    import json

    from acp.schema import PromptResponse, RequestPermissionRequest, SessionNotification

    PromptResponse.model_validate({"stopReason": "end_turn"})
    RequestPermissionRequest.model_validate(
        {"sessionId": "s", "toolCall": {"toolCallId": "t"}, "options": [
            {"optionId": "o", "name": "o", "kind": "allow_once"}]}
    )
    SessionNotification.model_validate(
        {"sessionId": "s", "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "x"}}}
    )
    json.loads(json.dumps({"a": [1, 2.5, None, True, "é"]}))


def _is_stdlib(name: str) -> bool:
    return name.split(".", 1)[0] in sys.stdlib_module_names


class LateImportWatch:
    """After ready: report every module imported from now on (an audit hook; it only records, the
    event loop logs). Non-standard-library modules are warnings (``agentctl_late_import``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, report: Callable[[str, bool], None]) -> None:
        self._loop = loop
        self._report = report
        self._seen: set[str] = set()
        self._pending: list[str] = []
        self._scheduled = False
        self.active = False

    def install(self) -> None:
        self.active = True
        sys.addaudithook(self._hook)  # hooks cannot be removed: ``active`` turns it off

    def _hook(self, event: str, args: tuple[object, ...]) -> None:
        if event != "import" or not self.active:
            return
        name = args[0]
        if not isinstance(name, str) or name in self._seen or name in sys.modules:
            return
        self._seen.add(name)
        self._pending.append(name)
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the process is ending
                pass

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        for name in pending:
            self._report(name, _is_stdlib(name))


def report_late_import(log_event: Callable[..., None], log: logging.Logger) -> Callable[[str, bool], None]:
    """The reporter ``main`` uses: a journal warning for a non-stdlib module, debug otherwise."""

    def report(name: str, stdlib: bool) -> None:
        if stdlib:
            log.debug("standard-library module %s imported after ready", name)
            return
        log_event(_EVENT, f"module {name} was imported after the control server reported ready: it comes"
                  " from whatever is installed now, not from the version this process started with",
                  priority=4, MODULE=name)

    return report
