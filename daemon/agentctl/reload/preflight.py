"""The preflight of a reload: the installed code proves it can take the running server over.

``kandev-agentctl --preflight`` (run by ``daemon.agentctl.reload.reexec`` in a
subprocess, with the code the next exec would load) imports every module the
server runs (``preload.import_everything``) and checks the private parts of the
SDK a hand-over uses (``acp_internals.check``), then says ``imported <version>``
on stdout. The server starts it *before* it quiesces, so this slow part costs no
pause. Then it reads the captured state (the very bytes of the memfd the exec will
hand over) from stdin and rebuilds everything of it that needs no process
resources: the launch settings (validated as at a start), ownership, and every
instance (its spec and log). It prints one JSON report line on stdout and exits
0; any failure exits 1 with the reason as the last line on stderr, and the
reload is refused. It binds nothing, starts nothing and logs nothing.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

IMPORTED = "imported"
"""The first line on stdout: every module imported, waiting for the state."""


def run() -> int:
    try:
        report = asyncio.run(_check())
    except BaseException as exc:  # everything, including an import that raises
        traceback.print_exc(file=sys.stderr)
        print(f"preflight failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(report, sort_keys=True), flush=True)
    return 0


async def _check() -> dict[str, Any]:
    from daemon.agentctl.reload import preload

    missing_optional = preload.import_everything()

    from daemon.agentctl import launch
    from daemon.agentctl.handover import decode, from_fields
    from daemon.agentctl.instance import acp_internals
    from daemon.agentctl.instance.conversation import TurnIds
    from daemon.agentctl.ownership import Ownership
    from daemon.agentctl.reload import instance_handover
    from daemon.agentctl.reload.reexec import code_root
    from daemon.core.version import VERSION

    acp_internals.check()
    print(f"{IMPORTED} {VERSION}", flush=True)
    data = sys.stdin.buffer.read()  # the server quiesces meanwhile, then sends the state and EOF
    state = decode(data)
    lost: list[str] = []
    config = from_fields(launch.LaunchConfig, state.launch, "launch", lost)
    launch.validate(config, check_secrets=False)  # as _resume does: a key gone never refuses a reload
    Ownership.from_snapshot(state.ownership)
    turn_ids = TurnIds(state.server_identity, state.turn_counter)
    not_taken_over: dict[str, list[str]] = {}
    for h in state.instances:
        inst = instance_handover.restore(h, agent_log_dir=config.agent_log_dir, turn_ids=turn_ids)
        if inst.not_taken_over:
            not_taken_over[inst.instance_id] = list(inst.not_taken_over)
    return {
        "ok": True,
        "version": VERSION,
        "from_version": state.from_version,
        "code_root": code_root(),
        "instances": len(state.instances),
        "lost": state.lost + lost,
        "not_taken_over": not_taken_over,
        "missing_optional_modules": missing_optional,
    }
