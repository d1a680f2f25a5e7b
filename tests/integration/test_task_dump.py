"""SIGUSR1 makes a daemon log what each of its asyncio tasks is waiting on, and nothing else.

The diagnostic that found Issue 5's hang (an event consumer left ``cancelling`` by a swallowed
cancellation); an operator sends it with ``systemctl kill --kill-whom=main -s USR1 UNIT``.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.processes import alive
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


def test_sigusr1_logs_every_task_with_its_await_chain_and_changes_nothing(kandev_factory, capsys):
    k = kandev_factory()
    st = k.up()
    task, sid = k.start_session("dump")
    show = k.show(sid)
    backend, server, agent = st["backend"]["pid"], st["control_server"]["pid"], show["agent_pid"]
    backend_log = k.home / "logs" / "backend.log"
    server_log = k.home / "logs" / "agentctl.log"

    os.kill(backend, signal.SIGUSR1)
    text = wait_until(lambda: t if "task 'events-" in (t := backend_log.read_text()) else None, timeout=20)
    dump = text[text.index("task dump requested (SIGUSR1)"):]
    consumer = dump[dump.index(f"task 'events-{sid}' pending"):]
    # the whole chain down to where the consumer waits, not only its outermost frame
    assert "in _run" in consumer.split("task '")[1] and "in _consume_once" in consumer.split("task '")[1]

    os.kill(server, signal.SIGUSR1)
    wait_until(lambda: "task dump requested (SIGUSR1)" in server_log.read_text(), timeout=20)

    # both daemons and the agent go on as before
    assert alive(backend) and alive(server) and alive(agent)
    k.cli("prompt", sid, "still here", "--wait")
    assert k.show(sid)["state"] == "WAITING_FOR_INPUT"
    assert k.status()["backend"]["pid"] == backend

    # what the fixture prints when a CLI call times out: one dump per daemon of this home
    k.print_task_dumps()
    printed = capsys.readouterr().out
    assert f"--- task dump of pid {backend} (backend.log)" in printed
    assert f"--- task dump of pid {server} (agentctl.log)" in printed
