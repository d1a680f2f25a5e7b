"""Benchmark: re-tracking N surviving sessions, from first contact to the last publication.

Run: ``python tests/bench/bench_recovery.py [N]`` (default 1000; target < 2 s).

Set-up: a real backend and control server (survival on, no service manager);
the backend is SIGKILLed; N instances are created on the surviving control
server with a minimal real ACP agent (a shell loop answering ``initialize``
and ``session/new``: the mock agent is a Python process of ~40 MB, a thousand
of them do not fit a 2-core test machine), and N tasks, sessions and
inventory rows are written to the store as a backend would have left them.
Then a new backend starts; its ``kandev status`` reports the recovery duration
measured from the first contact with the recorded endpoint.

Baseline, measured in the same run: one enumeration (``list_instances``) of
those N instances by a client, i.e. the cheapest possible look at them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.agentctl import launch as launch_file  # noqa: E402
from daemon.agentctl.client import AgentctlClient  # noqa: E402
from daemon.store.db import Store, sqlite_url  # noqa: E402
from daemon.store.models import ControlServerRecord, ExecutorRunning, Task, TaskSession  # noqa: E402

TARGET_S = 2.0
MINIMAL_AGENT = r"""
while IFS= read -r line; do
  id=$(printf '%s' "$line" | sed -n 's/.*"id": *\([0-9][0-9]*\).*/\1/p')
  case "$line" in
    *'"initialize"'*) printf '{"jsonrpc":"2.0","id":%s,"result":{"protocolVersion":1,"agentCapabilities":{}}}\n' "$id" ;;
    *'"session/new"'*) printf '{"jsonrpc":"2.0","id":%s,"result":{"sessionId":"bench-%s"}}\n' "$id" "$$" ;;
    *) [ -n "$id" ] && printf '{"jsonrpc":"2.0","id":%s,"error":{"code":-32601,"message":"not supported"}}\n' "$id" ;;
  esac
done
"""


def kandev(home: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "--home", str(home), "--json", *args],
        capture_output=True, text=True, env=env, timeout=900, check=True,
    )
    return json.loads(out.stdout)


async def create_instances(home: Path, n: int, workspace: Path) -> tuple[list[dict[str, Any]], float]:
    store = Store.open(sqlite_url(home / "kandev.db"))
    with store.session() as db:
        rec = db.get(ControlServerRecord, 1)
        endpoint, ref = rec.endpoint, rec.credential_ref
    credential = launch_file.read_credential_file(home / "secrets" / ref)
    installation = (home / "installation-id").read_text().strip()
    client = await AgentctlClient.connect(endpoint, credential=credential, installation_id=installation)
    made: list[dict[str, Any]] = []
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        session_id, task_id = uuid.uuid4().hex, uuid.uuid4().hex
        async with sem:
            info = await client.create_instance(
                session_id=session_id, task_id=task_id, command=["sh", "-c", MINIMAL_AGENT], cwd=str(workspace)
            )
        made.append({**info, "session_id": session_id, "task_id": task_id})

    await asyncio.gather(*(one(i) for i in range(n)))
    t0 = time.perf_counter()
    listed = await client.list_instances()
    enumeration = time.perf_counter() - t0
    assert len(listed) == n
    await client.close()
    with store.session() as db:
        for m in made:
            db.add(Task(id=m["task_id"], title="bench", workspace=str(workspace), executor="local",
                        state="in_progress"))
            db.flush()
            db.add(TaskSession(id=m["session_id"], task_id=m["task_id"], agent="mock", state="RUNNING",
                               metadata_json={"acp": {"session_id": m["acp_session_id"]}}, passthrough=False))
            db.flush()
            db.add(ExecutorRunning(
                session_id=m["session_id"], task_id=m["task_id"], instance_id=m["instance_id"], endpoint=endpoint,
                agent_pid=m["pid"], agent_pid_start_time=m["pid_start_time"], resume_token=m["acp_session_id"],
                workspace_path=str(workspace), runtime="standalone", agent_profile="mock", status="live",
                last_event_seq=0, created_by_boot="bench", metadata_json={},
            ))
    store.close()
    return made, enumeration


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    with tempfile.TemporaryDirectory(prefix="kd-rbench-", dir="/var/tmp") as d:
        root = Path(d)
        os.chmod(root, 0o700)
        home, workspace = root / "home", root / "ws"
        workspace.mkdir()
        config = root / "kandev.toml"
        config.write_text("")
        env = dict(os.environ, PYTHONPATH=str(REPO), KANDEV_CONFIG=str(config), KANDEV_FEATURES_AGENT_SURVIVAL="true")
        st = kandev(home, env, "up")["status"]
        ctl_pid = st["control_server"]["pid"]
        try:
            os.kill(st["backend"]["pid"], signal.SIGKILL)
            time.sleep(0.5)
            made, enumeration = asyncio.run(create_instances(home, n, workspace))
            st2 = kandev(home, env, "up")["status"]
            recovery_s = st2["recovery"]["duration_ms"] / 1000
            print(f"re-tracking N={n} surviving sessions")
            print(f"  baseline, one enumeration of {n} instances: {enumeration * 1000:8.1f} ms")
            print(f"  recovery, first contact to last publication: {recovery_s * 1000:8.1f} ms"
                  f"  ({st2['recovery']['retracked']} re-tracked, {st2['recovery']['not_retracked']} not)")
            print(f"  ratio recovery / enumeration: {recovery_s / enumeration:.1f}")
            ok = st2["recovery"]["retracked"] == n and recovery_s < TARGET_S
            print(f"  target < {TARGET_S:.0f} s with all {n} re-tracked: {'PASS' if ok else 'FAIL'}")
        finally:
            subprocess.run([sys.executable, "-m", "daemon.cli", "--home", str(home), "down"], env=env,
                           capture_output=True, timeout=120)
            try:
                os.kill(ctl_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            time.sleep(3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
