"""Sessions driven through the CLI of a ``Kandev`` home: starting them, resuming and restarting,
and reading what the store, the agent logs and the control server say about them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from daemon.agentctl import launch as launch_file
from daemon.agentctl.client.connection import AgentctlClient
from tests.support.kandev import Kandev, db_row

T = TypeVar("T")


def identities(k: Kandev, sid: str) -> tuple[str | None, str | None]:
    """RESUME-3: (task_sessions.metadata.acp.session_id, executors_running.resume_token)."""
    session = db_row(k, "SELECT metadata_json FROM task_sessions WHERE id = ?", sid)
    row = db_row(k, "SELECT resume_token FROM executors_running WHERE session_id = ?", sid)
    assert session is not None
    meta = json.loads(session["metadata_json"])
    return (meta.get("acp") or {}).get("session_id"), (row or {}).get("resume_token")


def metadata(k: Kandev, sid: str) -> dict[str, Any]:
    row = db_row(k, "SELECT metadata_json FROM task_sessions WHERE id = ?", sid)
    assert row is not None
    return json.loads(row["metadata_json"])


def agent_log(k: Kandev, instance_id: str) -> str:
    path = k.home / "logs" / "agents" / f"{instance_id}.stderr.log"
    return path.read_text(errors="replace") if path.exists() else ""


def new_task(k: Kandev, title: str, *extra: str) -> tuple[str, Path]:
    out = k.cli("task", "create", "--title", title, *extra)
    return out["task_id"], Path(out["workspace"])


def start(k: Kandev, task: str) -> str:
    sid = k.cli("session", "start", task)["session_id"]
    k.show(sid)
    return sid


def switches(ws: Path, text: str | None) -> None:
    path = ws / ".kandev-mock.toml"
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(text)


def refused(k: Kandev, *args: str) -> dict[str, Any]:
    proc = k.run(*args)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    return json.loads(proc.stdout)["error"]


def restart(k: Kandev, **env: str) -> dict[str, Any]:
    k.cli("down", timeout=90)
    k.env.update(env)
    return k.up()


def agentctl_caller(k: Kandev) -> Callable[[Callable[[AgentctlClient], Awaitable[T]]], T]:
    """Run ``fn(client)`` against the control server with this home's current credential."""
    rec = db_row(k, "SELECT * FROM control_server_record WHERE id = 1")
    assert rec is not None
    credential = launch_file.read_credential_file(k.home / "secrets" / rec["credential_ref"])
    installation = (k.home / "installation-id").read_text().strip()

    def call(fn: Callable[[AgentctlClient], Awaitable[T]]) -> T:
        async def go() -> T:
            client = await AgentctlClient.connect(rec["endpoint"], credential=credential,
                                                  installation_id=installation)
            try:
                return await fn(client)
            finally:
                await client.close()

        return asyncio.run(go())

    return call
