"""``daemon.heap.freeze_startup_heap``: what is alive is frozen (left out of later collections),
and garbage start-up left behind is collected first, not frozen with it."""

from __future__ import annotations

import gc
import weakref

from daemon.heap import freeze_startup_heap


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
