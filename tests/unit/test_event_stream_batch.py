"""An attach stream sends what is already retained together: ``Subscription.ready``
hands out the retained events after the cursor in seq order, never one twice, never past the end."""

from __future__ import annotations

import asyncio

from daemon.agentctl.instance.events import EventLog


def test_ready_takes_retained_events_in_order_up_to_the_limit():
    """AC-EXECUTORS-SURVIVAL-001.5: every retained event once, in order."""

    async def run() -> list[int]:
        log = EventLog()
        for i in range(10):
            log.append("session_update", {"i": i})
        sub = log.subscribe(after_seq=2)
        seen = [e.seq for e in [await sub.next(), *sub.ready(4)] if e is not None]
        seen += [e.seq for e in sub.ready(100)]
        assert sub.ready(100) == []  # nothing past the end
        log.append("session_update", {"i": 10})
        seen += [e.seq for e in sub.ready(100)]
        sub.close()
        assert sub.ready(100) == []
        return seen

    assert asyncio.run(run()) == list(range(3, 12))


def test_ready_skips_what_an_ack_discarded():
    log = EventLog()
    for i in range(5):
        log.append("session_update", {"i": i})
    sub = log.subscribe(after_seq=0)
    log.discard_through(3)
    assert [e.seq for e in sub.ready(10)] == [4, 5]
