"""Issue 45 scenario A: automatic resume after a control-server loss, more sessions than it
launches at once (``AUTO_RESUME_PARALLEL``): every session is STARTING from the start (its resume
is under way), none waits WAITING_FOR_INPUT without an agent while the board keeps it out of
needs_attention. Read from the order of the backend's log, never from a clock."""

from __future__ import annotations

import os
import signal

import pytest

from daemon.backend.sessions.resume import AUTO_RESUME_PARALLEL
from tests.support.kandev import Kandev
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(240)
SESSIONS = AUTO_RESUME_PARALLEL + 2


def _log(k: Kandev) -> list[str]:
    return (k.home / "logs" / "backend.log").read_text(errors="replace").splitlines()


def test_queued_automatic_resumes_are_starting_before_the_first_launch_ends(kandev_factory) -> None:
    """Issue 45 scenario A: SESSIONS sessions, the control server SIGKILLed: each is STARTING
    (automatic resume) before the first of them is ready again; all get their agent back."""
    k = kandev_factory(KANDEV_FEATURES_AGENT_SURVIVAL="true", KANDEV_FEATURES_AUTO_RESUME="true")
    st = k.up()
    sids = [k.start_session(f"queue {i}")[1] for i in range(SESSIONS)]
    os.kill(st["control_server"]["pid"], signal.SIGKILL)
    k.server_pids.discard(int(st["control_server"]["pid"]))
    for sid in sids:
        wait_until(lambda sid=sid: (s := k.show(sid))["live"] and s["state"] == "WAITING_FOR_INPUT"
                   and s["agent_pid"] is not None and "session_resumed" in [m["kind"] for m in s["transcript"]],
                   timeout=180)
    lines = _log(k)
    start = max(i for i, line in enumerate(lines) if "automatic resume of" in line)
    after = lines[start:]
    starting = [i for i, line in enumerate(after) if "-> STARTING (automatic resume)" in line]
    ready = [i for i, line in enumerate(after) if "agent ready (resumed)" in line]
    assert len(starting) == SESSIONS and len(ready) == SESSIONS, (starting, ready)
    assert max(starting) < min(ready), "\n".join(after[:60])
