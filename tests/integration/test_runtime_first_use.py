"""First use of a managed npm runtime prepares it (Issue 12 item 3).

The daemons get an npm cache of their own that holds npm's downloaded tarballs (a copy of the
shared test cache's ``_cacache``, so no large download) but no prepared ``_npx`` tree: the
claude-code runtime was never prepared there. Starting a claude-code session then runs the runtime
job first (the CLI prints its steps; ``session show`` shows it while the session is STARTING)
instead of failing with ``runtime_not_prepared``, and the agent then does a real turn.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.api import ops as api
from daemon.runtimes.npx_cache import NPX_DIR, npx_key
from ipc.client import SyncClient
from tests.support.kandev import make_env
from tests.support.messages_standin import MessagesStandIn
from tests.support.npm_runtimes import CLAUDE, is_prepared
from tests.support.streams import agent_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)


def test_first_use_runs_the_runtime_job_first(short_tmp: Path, claude_npm_cache: Path, kandev_factory: Any) -> None:
    """Issue 12 item 3: a session start of claude-code whose runtime is not prepared runs the
    runtime job first, its progress on the CLI's stderr and in ``session show`` (backend path), then
    starts the agent, which completes a turn."""
    cache = short_tmp / "npm"
    cache.mkdir()
    shutil.copytree(claude_npm_cache / "_cacache", cache / "_cacache")
    key = short_tmp / "key"
    key.write_text("sk-first-use\n")
    key.chmod(0o600)
    with MessagesStandIn() as standin:
        k = kandev_factory(config_text=(
            standin.network_table()  # the agent reaches it through its egress proxy (Issue 44)
            + "[agents.claude-code]\n"
            f'env = {{ ANTHROPIC_BASE_URL = "{standin.base_url}" }}\n'
            f'secret_env = {{ ANTHROPIC_API_KEY = "{key}" }}\n'))
        k.env = make_env(Path(k.env["KANDEV_CONFIG"]), npm_config_cache=str(cache))
        k.up()
        assert not is_prepared(CLAUDE, cache)
        task = k.cli("task", "create", "--title", "first use")["task_id"]

        # The CLI: the job's steps on stderr, then the session.
        p = k.human("session", "start", task, "--agent", "claude-code", timeout=280)
        assert p.returncode == 0, p.stderr
        assert "runtime of claude-code is not prepared yet" in p.stderr
        assert "preparing claude-code: [updating]" in p.stderr and "[succeeded]" in p.stderr
        assert is_prepared(CLAUDE, cache)
        sid = k.cli("session", "list")["sessions"][-1]["session_id"]
        standin.script(["prepared", " and", " running"])
        assert k.cli("prompt", sid, "hi", "--wait", timeout=90)["stop_reason"] == "end_turn"
        assert [c for c in agent_chunks(k.show(sid)) if c] == ["prepared", " and", " running"]

        # The backend on its own (a client that does not prepare first): STARTING shows the job.
        shutil.rmtree(cache / NPX_DIR / npx_key(CLAUDE.npm_spec))
        result: dict[str, Any] = {}

        def start() -> None:
            with SyncClient(str(k.home / "run" / "backend.sock"), protocol_major=api.VERSION[0], timeout=5.0) as c:
                result.update(c.call("session_start", {"task_id": task, "agent": "claude-code"}, timeout=280))

        t = threading.Thread(target=start, daemon=True)
        t.start()

        def preparing() -> dict[str, Any] | None:
            for s in k.cli("session", "list")["sessions"]:
                if s["state"] == "STARTING":
                    show = k.cli("session", "show", s["session_id"])
                    if show.get("runtime_prepare"):
                        return show
            return None

        show = wait_until(preparing, timeout=120, message="a STARTING session showing its runtime job")
        assert show["runtime_prepare"]["agent"] == "claude-code"
        assert show["runtime_prepare"]["spec"] == CLAUDE.npm_spec
        text = k.human("session", "show", show["session_id"]).stdout
        assert "Runtime:" in text and CLAUDE.npm_spec in text
        t.join(280)
        assert result.get("session_id") == show["session_id"], result
        done = k.show(show["session_id"])
        assert done["state"] == "WAITING_FOR_INPUT" and done["runtime_prepare"]["state"] == "succeeded"
        assert is_prepared(CLAUDE, cache)
