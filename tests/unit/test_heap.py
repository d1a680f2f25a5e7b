"""``daemon.core.heap``: what is alive is frozen (left out of later collections); ``freeze_startup_heap``
collects start-up's garbage first, ``freeze_before_recovery`` does not (it saves a full walk), and a
later ``freeze_startup_heap`` still collects what was made after it."""

from __future__ import annotations

import gc
import weakref

from daemon.core.heap import freeze_before_recovery, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_live_objects_are_frozen_and_start_up_garbage_is_collected_first() -> None:
    alive = [_Node() for _ in range(100)]
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle nobody refers to: garbage only the collector can free
    garbage = weakref.ref(a)
    del a, b
    try:
        frozen = freeze_startup_heap()
        assert garbage() is None  # collected before the freeze, not kept forever
        assert frozen == gc.get_freeze_count() >= len(alive)
        assert gc.is_tracked(alive[0])
    finally:
        gc.unfreeze()  # this test process goes on as it was


def test_the_freeze_before_recovery_leaves_a_collection_for_later() -> None:
    early = [_Node() for _ in range(100)]
    try:
        frozen_early = freeze_before_recovery()
        assert frozen_early == gc.get_freeze_count() >= len(early)
        a, b = _Node(), _Node()  # what recovery made: a cycle that becomes garbage
        a.other, b.other = b, a
        garbage = weakref.ref(a)
        del a, b
        freeze_startup_heap()  # once ready: collected first, not frozen
        assert garbage() is None
        assert gc.get_freeze_count() >= frozen_early
    finally:
        gc.unfreeze()
