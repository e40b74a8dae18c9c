"""The garbage collector is kept out of the step loop without leaking what it froze."""

from __future__ import annotations

import gc

from tpserve.scheduler.gc_control import frozen_heap


def test_frozen_heap_freezes_for_the_run_only():
    before = gc.get_freeze_count()
    objects = [[i] for i in range(1000)]
    with frozen_heap():
        assert gc.get_freeze_count() >= before + len(objects)
    assert gc.get_freeze_count() == before


def test_frozen_heap_unfreezes_after_an_error():
    before = gc.get_freeze_count()
    try:
        with frozen_heap():
            raise RuntimeError("step failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == before
